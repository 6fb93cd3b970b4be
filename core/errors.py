"""Operating errors: expected failures that the CLI prints as one line naming the thing and the fix."""
from __future__ import annotations


class UserError(Exception):
    """Bad config, missing file, unknown name…: the message says what and what to do."""
