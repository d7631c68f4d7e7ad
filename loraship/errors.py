"""User-facing errors: the CLI prints these without a traceback and exits non-zero."""


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
