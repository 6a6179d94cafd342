"""Errors that carry a one-line reason a user can act on."""


def one_line(text: str, limit: int | None = None) -> str:
    """text with every run of whitespace (newlines included) as one space, cut to `limit`
    characters with "..." at the end when longer."""
    line = " ".join(text.split())
    return line if limit is None or len(line) <= limit else line[: limit - 3] + "..."


class CpudError(Exception):
    """Base class: str(error) is a single line that says what to change."""


class ConfigError(CpudError, ValueError):
    """The model directory, a flag or an environment variable is unusable."""


class RequestError(CpudError, ValueError):
    """A request cannot be served as given (bad parameter, too long, ...)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code
