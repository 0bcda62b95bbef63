"""Pure-torch reference ops: the oracle every kernel is checked against."""
