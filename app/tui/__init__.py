"""The terminal app (`kvchat` with no arguments): Textual screens and widgets over app/session/service.py."""
