"""llama.cpp and GGUF: the pinned converter, reading GGUF files, llama.cpp in a child process, Ollama, the served
check."""
