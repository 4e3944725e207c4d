"""Errors that users can act on."""


class UserError(Exception):
    """Bad input the user can fix; the CLI prints it as one line and exits 2."""


class AgreedError(UserError):
    """A UserError that every rank raised from one collective verdict (e.g. the shared-storage check):
    the ranks know rank 0 reports it, so none needs to wait to see whether rank 0 did (sdzero.train)."""


EXIT_USER_ERROR = 2
