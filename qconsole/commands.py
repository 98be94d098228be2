"""Command palette (ctrl+p): every key of the app and of the current screen, plus commands on named queues
and job types, so nothing is reachable only by a key someone has to remember."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, cast

from textual.binding import Binding
from textual.command import DiscoveryHit, Hit, Hits, Provider

if TYPE_CHECKING:
    from qconsole.app import QConsoleApp

Command = tuple[str, str, Callable[[], object]]


class ConsoleCommands(Provider):
    @property
    def qapp(self) -> QConsoleApp:
        return cast("QConsoleApp", self.app)

    def commands(self) -> list[Command]:
        app = self.qapp
        screen = self.screen
        out: list[Command] = []
        title = getattr(screen, "TITLE_TEXT", "") or "Screen"
        seen: set[str] = set()
        for b in getattr(screen, "BINDINGS", []):
            if isinstance(b, Binding) and b.description and b.action not in seen:
                seen.add(b.action)
                key = b.key_display or b.key
                out.append(
                    (f"{title}: {b.description}", f"key {key}", partial(app.call_later, screen.run_action, b.action))
                )
        for b in app.BINDINGS:
            if isinstance(b, Binding) and b.description:
                key = b.key_display or b.key
                out.append((f"{b.description}", f"key {key}", partial(app.call_later, app.run_action, b.action)))
        # pause for a queue that runs, resume for a paused one (both were offered: a confirmed resume of a queue
        # that was not paused audited a no-op); neither for a queue the overview has not read yet
        paused = app.queues_paused()
        for queue in app.known_queues:
            is_paused = paused.get(queue)
            if is_paused is not None:
                verb = "Resume" if is_paused else "Pause"
                ask = partial(app.request_pause, queue, not is_paused)
                out.append((f"{verb} queue {queue}", "asks for confirmation", ask))
            out.append((f"Jobs in queue {queue}", "jobs screen, filtered", partial(app.open_jobs, queue=queue)))
        for job_type in app.known_types:
            out.append((f"Jobs of type {job_type}", "jobs screen, filtered", partial(app.open_jobs, job_type=job_type)))
        for state in ("dead_lettered", "failed", "running", "retry_scheduled", "queued"):
            out.append((f"Jobs {state}", "jobs screen, filtered", partial(app.open_jobs, state=state)))
        return out

    async def discover(self) -> Hits:
        for text, help_text, callback in self.commands():
            yield DiscoveryHit(text, callback, help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for text, help_text, callback in self.commands():
            score = matcher.match(text)
            if score > 0:
                yield Hit(score, matcher.highlight(text), callback, help=help_text)
