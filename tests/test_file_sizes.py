"""No module of loraship/ or tasks/ over 600 lines: one readable in a sitting, split by responsibility past that."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 600


def too_long(root: Path, folders: tuple[str, ...] = ("loraship", "tasks"), limit: int = MAX_LINES) -> dict[str, int]:
    """Each .py file under `folders` longer than `limit` lines -> its line count, by path inside `root`; a file
    reached twice (loraship/stages may be a link to tasks/) counts once."""
    found, seen = {}, set()
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            real = path.resolve()
            if real in seen:
                continue
            seen.add(real)
            with open(real, encoding="utf-8") as f:
                lines = sum(1 for _ in f)
            if lines > limit:
                found[real.relative_to(root.resolve()).as_posix()] = lines
    return found


def test_no_module_is_over_600_lines():
    assert len(list((ROOT / "loraship").rglob("*.py"))) > 20, "found (nearly) no modules to measure"
    found = too_long(ROOT)
    assert not found, (
        "; ".join(f"{path}: {lines} lines (over {MAX_LINES})" for path, lines in sorted(found.items()))
        + "; fix: move a part with one responsibility into a new, well-named module"
    )


def test_the_measure_names_a_file_one_line_over(tmp_path):
    (tmp_path / "loraship" / "sub").mkdir(parents=True)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "loraship" / "sub" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1), encoding="utf-8")
    (tmp_path / "tasks" / "exact.py").write_text("x = 1\n" * MAX_LINES, encoding="utf-8")
    (tmp_path / "tasks" / "notes.txt").write_text("x\n" * (MAX_LINES + 5), encoding="utf-8")
    assert too_long(tmp_path) == {"loraship/sub/long.py": MAX_LINES + 1}
