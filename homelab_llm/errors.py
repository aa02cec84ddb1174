"""The base of every error a user can act on. The CLI prints these as one line, never a traceback."""


class HomelabError(Exception):
    """Bad input or an unmet requirement; str(err) tells the user what to change."""
