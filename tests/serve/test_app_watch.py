"""The lifetime rule of the cluster tier's detached actors (`serve.replica.app_watch`): an actor ends
once its application has been missing for `strikes` polls in a row, and only then; a poll that cannot
tell (the Serve controller is restarting or gone) counts as missing."""

from __future__ import annotations

from lora_cluster.serve.replica.app_watch import AppWatch, WatchState


class Answers:
    """`exists` answering from a script (True, False, or an exception to raise)."""

    def __init__(self, *answers: object):
        self.answers, self.asked = list(answers), 0

    def __call__(self, app: str) -> bool:
        answer = self.answers[min(self.asked, len(self.answers) - 1)]
        self.asked += 1
        if isinstance(answer, Exception):
            raise answer
        return bool(answer)


def test_an_actor_ends_after_its_app_is_missing_twice_in_a_row() -> None:
    ended: list[str] = []
    watch = AppWatch("app", Answers(True, False, True, False, False, False), lambda: ended.append("x"))
    states = [watch.poll() for _ in range(6)]
    assert states[:4] == [WatchState.WATCHING] * 4, "one missing answer between two found ones ends nothing"
    assert states[4] is WatchState.GONE, "the second missing answer in a row ends the actor"
    assert ended == ["x"], "on_gone runs once, even when polled again"


def test_a_poll_that_cannot_tell_counts_as_missing() -> None:
    ended: list[bool] = []
    watch = AppWatch("app", Answers(RuntimeError("no controller")), lambda: ended.append(True))
    watch.poll()
    assert watch.poll() is WatchState.GONE, "two polls that cannot reach Serve end the actor"
    assert ended == [True], "on_gone ran"


def test_a_stopped_watch_ends_nothing() -> None:
    ended: list[bool] = []
    watch = AppWatch("app", Answers(False), lambda: ended.append(True))
    watch.stop()
    assert [watch.poll(), watch.poll()] == [WatchState.STOPPED] * 2, "a stopped watch stays stopped"
    assert ended == [], "on_gone never ran"
