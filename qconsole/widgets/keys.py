"""Two key lines instead of one footer: this screen's keys, then the keys that work everywhere.

At 80 columns one footer cannot hold both, and keys scrolled out of sight are keys nobody finds. A key that
does not fit whole is left out, not cut (the app's line ended "^p Pal" at 80 columns): ``?`` lists every key.
"""

from __future__ import annotations

from typing import Any, Literal

from rich.cells import cell_len
from textual import events
from textual.app import ComposeResult
from textual.widgets import Footer
from textual.widgets._footer import FooterKey


class KeyLine(Footer):
    """A Footer that shows only the screen's (and focused widget's) keys, or only the App's."""

    DEFAULT_CSS = """
    KeyLine {
        dock: none;
    }
    KeyLine.-app {
        background: $footer-background 70%;
    }
    """

    def __init__(self, scope: Literal["screen", "app"], **kwargs: Any) -> None:
        kwargs.setdefault("compact", True)
        kwargs.setdefault("show_command_palette", False)
        super().__init__(**kwargs)
        self.scope = scope
        #: the width the keys were laid out for
        self._composed_for = -1
        self.add_class(f"-{scope}")

    def compose(self) -> ComposeResult:
        if not self._bindings_ready:
            return
        seen: set[str] = set()
        room = self.size.width or self.app.size.width
        self._composed_for = self.size.width
        used = 0
        for node, binding, enabled, tooltip in self.screen.active_bindings.values():
            if not binding.show or (node is self.app) != (self.scope == "app") or binding.action in seen:
                continue
            seen.add(binding.action)
            display = self.app.get_key_display(binding)
            # compact: the key, a space, its description, and a space before the next key
            used += (1 if used else 0) + cell_len(display) + 1 + cell_len(binding.description)
            if used > room:
                return
            yield FooterKey(
                binding.key,
                display,
                binding.description,
                binding.action,
                disabled=not enabled,
                tooltip=tooltip,
            ).data_bind(compact=Footer.compact)

    def on_resize(self, event: events.Resize) -> None:
        if event.size.width != self._composed_for:  # the keys that fit are others
            self.refresh(recompose=True)
