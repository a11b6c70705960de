"""User-facing errors: one clear line, exit code 2 in the CLI."""


class UserError(ValueError):
    """Bad input from the user (model path, option value, prompt length, device).

    The CLI prints ``error: <message>`` on stderr and exits with code 2, no traceback.
    ``param``: the option or field at fault, where one is (a server's 400 names it).
    """

    def __init__(self, message: str = "", param: str | None = None):
        super().__init__(message)
        self.param = param


class HostBudgetError(UserError):
    """A plan whose KV pages need more host memory than its host budget (a caller that
    chose that budget itself, such as ``plan`` from this machine's memory, may say so)."""


class HostPagesRefused(UserError):
    """The host arena could not grow to the pages a step planned (page-locking was refused);
    it holds ``num_pages`` pages still."""

    def __init__(self, message: str, num_pages: int):
        super().__init__(message)
        self.num_pages = num_pages
