"""Two key lines instead of one footer: this screen's keys, then the keys that work everywhere.

At 80 columns one footer cannot hold both, and keys scrolled out of sight are keys nobody finds.
"""

from __future__ import annotations

from typing import Any, Literal

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
        self.add_class(f"-{scope}")

    def compose(self) -> ComposeResult:
        if not self._bindings_ready:
            return
        seen: set[str] = set()
        for node, binding, enabled, tooltip in self.screen.active_bindings.values():
            if not binding.show or (node is self.app) != (self.scope == "app") or binding.action in seen:
                continue
            seen.add(binding.action)
            yield FooterKey(
                binding.key,
                self.app.get_key_display(binding),
                binding.description,
                binding.action,
                disabled=not enabled,
                tooltip=tooltip,
            ).data_bind(compact=Footer.compact)
