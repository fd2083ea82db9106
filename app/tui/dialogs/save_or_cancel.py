"""What the settings-like dialogs share: their Save button and Enter in any of their fields save
(`action_save`), any other button cancels (`action_cancel`)."""

from __future__ import annotations

from textual.widgets import Button, Input


class SaveOrCancel:
    """A mixin for a ModalScreen that defines `action_save` and `action_cancel`."""

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        else:
            self.action_cancel()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.action_save()
