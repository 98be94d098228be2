"""Two key lines instead of one footer: this screen's keys, then the keys that work everywhere.

At 80 columns one footer cannot hold both, and keys scrolled out of sight are keys nobody finds. A key that
does not fit whole is left out, not cut (the app's line ended "^p Pal" at 80 columns); ``?``, which lists every
key, is kept.
"""

from __future__ import annotations

from typing import Any, Literal

from rich.cells import cell_len
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
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

    #: kept when the line is short of room: the key that lists every other
    KEEP = frozenset({"help"})

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
        shown = []
        for node, binding, enabled, tooltip in self.screen.active_bindings.values():
            if not binding.show or (node is self.app) != (self.scope == "app") or binding.action in seen:
                continue
            seen.add(binding.action)
            shown.append((binding, enabled, tooltip))
        self._composed_for = self.size.width
        for binding, enabled, tooltip in self._fitting(shown, self.size.width or self.app.size.width):
            yield FooterKey(
                binding.key,
                self.app.get_key_display(binding),
                binding.description,
                binding.action,
                disabled=not enabled,
                tooltip=tooltip,
            ).data_bind(compact=Footer.compact)

    def _fitting(self, keys: list[tuple[Binding, bool, str]], room: int) -> list[tuple[Binding, bool, str]]:
        """The keys that fit whole in ``room`` columns, in their order; ``?`` (it lists the others) first of all."""

        def width(binding: Binding) -> int:  # compact: the key, a space, its description; a space between keys
            return cell_len(self.app.get_key_display(binding)) + 1 + cell_len(binding.description) + 1

        used = sum(width(b) for b, _, _ in keys if b.action in self.KEEP) - 1  # no space after the last
        fitting = []
        for key in keys:
            if key[0].action not in self.KEEP:
                if used + width(key[0]) > room:
                    continue
                used += width(key[0])
            fitting.append(key)
        return fitting

    def on_resize(self, event: events.Resize) -> None:
        if event.size.width != self._composed_for:  # the keys that fit are others
            self.refresh(recompose=True)
