"""The one error class for mistakes a user can fix (a bad file, field, flag or run-dir state).

Stages raise UserError with a message that names the file and the field, line or sample; the CLI
prints it as one line and exits non-zero. Anything else is a bug and keeps its traceback. It is a
ValueError so that callers validating values (config parsing) can catch both alike.
"""

from __future__ import annotations


class UserError(ValueError):
    pass
