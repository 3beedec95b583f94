"""Every failure the codec reports is a DeltaError; the subclasses say which check failed."""


class DeltaError(Exception):
    """Base class: a delta could not be read, verified or applied. Nothing was changed."""


class FormatError(DeltaError):
    """Not a delta file, an unknown format version, or a truncated file."""


class CorruptError(DeltaError):
    """Bytes do not match their checksum, or a record does not decode."""


class MismatchError(DeltaError):
    """The delta does not fit the state it is applied to (base hash, tensors, shapes, dtypes)."""


class VerifyError(DeltaError):
    """The state after applying would not hash to the target the delta promises."""
