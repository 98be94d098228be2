"""The confirmation every row-changing action (and the stop of an embedded worker) goes through: says what it
touches, waits for ``y``; ``r`` first gives the reason the audit log keeps with it."""

from __future__ import annotations

from rich.text import Text
from textual import events, on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Static

#: a reason is a sentence for the audit log, not a document
MAX_REASON_LENGTH = 500


class ConfirmScreen(ModalScreen[bool]):
    """``dismiss(True)`` on ``y`` (or enter in the reason), with ``reason`` set when one was typed; ``n`` or
    ``escape`` dismiss with False.

    A key typed before the question was on the screen answers nothing: over a slow SSH link, keys arrive in a
    burst, and a ``y`` meant for something else (or typed ahead by habit) did the action unread."""

    DEFAULT_CSS = """
    ConfirmScreen {
        align: center middle;
        background: $background 60%;
    }
    ConfirmScreen > Vertical {
        width: 64;
        max-width: 95%;
        height: auto;
        border: thick $warning;
        background: $panel;
        padding: 0 1;
    }
    ConfirmScreen #confirm-question {
        text-style: bold;
        margin-bottom: 1;
    }
    ConfirmScreen #confirm-keys {
        margin-top: 1;
        color: $text-muted;
    }
    ConfirmScreen #confirm-reason {
        display: none;
        margin-top: 1;
    }
    ConfirmScreen.reasoning #confirm-reason {
        display: block;
    }
    """

    #: nothing focused: y, n and r are the screen's keys until r shows the reason's input (auto-focused, the
    #: hidden input took every key, y included, as letters of a reason)
    AUTO_FOCUS = ""

    BINDINGS = [
        Binding("y", "answer(True)", "Yes, do it"),
        Binding("n", "answer(False)", "No"),
        Binding("r", "reason", "Reason", tooltip="Say why: the audit log keeps it with the action"),
        Binding("escape", "escape", "Cancel", show=False),
    ]

    def __init__(self, question: str, details: str = "", *, action: str = "confirm", ask_reason: bool = True) -> None:
        super().__init__()
        self.question = question
        self.details = details
        self.action_name = action
        self.ask_reason = ask_reason
        #: what the operator typed as the reason (None: none given)
        self.reason: str | None = None
        #: answered: a second answer (enter twice, its Submitted delivered after the first dismissed the
        #: question) popped the screen below it, and the console died of an empty screen stack
        self.answered = False
        from textual import _time

        # the clock Textual stamps its key events with: a key stamped before this was typed before the question
        self._asked_at = _time.get_time()

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(Text(self.question), id="confirm-question")
            if self.details:
                yield Static(Text(self.details), id="confirm-details")
            if self.ask_reason:
                yield Input(
                    placeholder="why (kept in the audit log): enter does it, esc goes back",
                    max_length=MAX_REASON_LENGTH,
                    id="confirm-reason",
                )
            yield Static(self._keys(), id="confirm-keys")

    def _keys(self) -> Text:
        keys = Text()
        if self.has_class("reasoning"):
            keys.append("enter", style="bold reverse")
            keys.append(f" {self.action_name}   ")
            keys.append("esc", style="bold reverse")
            keys.append(" back to the question")
            return keys
        keys.append("y", style="bold reverse")
        keys.append(f" {self.action_name}   ")
        if self.ask_reason:
            keys.append("r", style="bold reverse")
            keys.append(" with a reason   ")
        keys.append("n", style="bold reverse")
        keys.append(" / ")
        keys.append("esc", style="bold reverse")
        keys.append(" cancel")
        return keys

    def on_mount(self) -> None:
        self.query_one(Vertical).border_title = "Confirm"

    def on_key(self, event: events.Key) -> None:
        if event.time < self._asked_at:
            # typed before the question showed: it answers nothing (it reached this screen, as the app's
            # queue held it, only because the question was pushed before it was handled)
            event.stop()
            event.prevent_default()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in ("answer", "reason") and self.has_class("reasoning"):
            return False  # y, n and r are letters of the reason being typed
        return self.ask_reason or action != "reason"

    def action_answer(self, yes: bool) -> None:
        self._answer(yes)

    def _answer(self, yes: bool) -> None:
        if self.answered:
            return
        self.answered = True
        self.dismiss(yes)

    def action_reason(self) -> None:
        self.add_class("reasoning")
        self.query_one("#confirm-keys", Static).update(self._keys())
        self.query_one("#confirm-reason", Input).focus()

    def action_escape(self) -> None:
        if self.has_class("reasoning"):  # back to the question, the reason typed so far dropped
            reason = self.query_one("#confirm-reason", Input)
            reason.value = ""
            self.remove_class("reasoning")
            self.set_focus(None)
            self.query_one("#confirm-keys", Static).update(self._keys())
            return
        self._answer(False)

    @on(Input.Submitted, "#confirm-reason")
    def _reasoned(self, event: Input.Submitted) -> None:
        event.stop()
        if not self.answered:
            self.reason = event.value.strip() or None
        self._answer(True)
