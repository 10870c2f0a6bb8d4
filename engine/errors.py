"""Errors meant for the user: one line that names the problem, shown without a traceback."""


class XlaserveError(Exception):
    """An error whose message is meant for the user: one line, names the problem."""


class ModelLoadError(XlaserveError):
    """A checkpoint, GGUF file or tokenizer that cannot be loaded as given."""


class UnsupportedModelError(ModelLoadError):
    """An architecture, tensor type or feature that xlaserve does not implement."""


class InvalidRequestError(XlaserveError, ValueError):
    """A request (prompt, sampling parameters) that cannot be served as given; `param` names
    the offending field (OpenAI's error shape has it)."""

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.param = param
