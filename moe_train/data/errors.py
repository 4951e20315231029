"""The one exception type of the data package, so callers can catch data problems as a group."""


class DataError(ValueError):
    """A dataset, tokenizer or input file is missing, malformed or inconsistent with the model.

    Messages name the offending file so the user can act on them without a traceback.
    """
