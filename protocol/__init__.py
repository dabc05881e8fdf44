"""What every part of a node says on the wire, shared by `engine` and `transport` (imports nothing)."""
