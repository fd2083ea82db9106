"""Modal dialogs: each returns its answer through `dismiss` (None when closed with Escape)."""
