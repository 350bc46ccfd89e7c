from ..errors import UserError


class ConversionError(UserError):
    """A problem with the converter's input or options, reported to the user as one line."""
