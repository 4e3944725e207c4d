"""Errors that users can act on."""


class UserError(Exception):
    """Bad input the user can fix; the CLI prints it as one line and exits 2."""


EXIT_USER_ERROR = 2
