"""User-facing errors: the CLI prints these without a traceback and exits with their code (2: input to fix)."""


class LorashipError(Exception):
    """A problem the user can fix; the message names it and the fix."""

    exit_code = 2


class ConfigError(LorashipError):
    def __init__(self, source: str, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source}: {len(problems)} problem(s):\n{lines}")


class DataError(LorashipError):
    pass


class IntegrityError(LorashipError):
    """An input's checksum or structure does not match what its manifest promised."""


class OutputError(LorashipError):
    pass


class StageFailed(LorashipError):
    """The inputs were accepted, but a stage's result failed its checks (verify's gates): not input to fix."""

    exit_code = 1


def exit_code_of(error: BaseException | None) -> int:
    """2 for input the user must fix (the classes above), 1 for a stage that failed or crashed."""
    return error.exit_code if isinstance(error, LorashipError) else 1
