"""The terminal app (`kvchat` with no arguments): Textual screens and widgets over app/tui/backend.py."""
