class ConversionError(Exception):
    """A problem with the converter's input or options, reported to the user as one line."""
