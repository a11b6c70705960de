"""User-facing errors: one clear line, exit code 2 in the CLI."""


class UserError(ValueError):
    """Bad input from the user (model path, option value, prompt length, device).

    The CLI prints ``error: <message>`` on stderr and exits with code 2, no traceback.
    """
