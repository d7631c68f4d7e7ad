"""The verify stage's parts (tasks/verify.py runs them in order): gates (figures -> a typed Gate each), scoring (KL,
perplexity, golden answers against the reference), the llama.cpp measuring child, the target device, and the figures
and picture verify.json's readers quote."""
