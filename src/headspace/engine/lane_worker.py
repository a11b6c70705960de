"""A lane stepped on a thread of its own, and on a CUDA stream of its own: its copies over
PCIe and its CPU attention jobs never stand between two steps of the engine's thread, whose
lane keeps the GPU busy meanwhile.

With ``prefill_sms`` (the engine's ``prefill_sm_share`` below 1), its prompt pieces run,
beside the engine's thread's decoding requests (``beside``), on a stream confined to part of
the GPU's SMs (a CUDA green context): a decode step's kernels then always find free SMs,
instead of waiting for a long attention block to leave one.

The engine's thread hands it commands (add a request, abort one, take another part of the
arena), which run between its steps in the order given, and empties the box its outputs
wait in. Where CUDA runs, it records an event on its stream each time it finds nothing to
do, so that the engine's thread can order its own work after the lane's last step.
"""

from __future__ import annotations

import queue
import threading
import warnings
from collections.abc import Callable

import torch

from headspace.engine.lane import Lane
from headspace.engine.outputs import RequestOutput
from headspace.model.llama import DEVICE_LOCK

IDLE_WAIT_S = 0.05  # how long an idle worker waits for a command before looking again
GREEN_SM_STEP = 8  # a green context's SMs come in groups of this many (Hopper's clusters)


class LaneWorker:
    """Steps ``lane`` on its own thread (started at the first command); on a GPU its work
    runs on a stream of ``priority`` while it prefills a prompt, of ``decode_priority``
    between prompts (higher numbers are lower priorities): a long prompt's kernels yield to
    the engine's thread's steps, while a decode step's few small kernels, which the lane's
    CPU attention and copies wait on layer by layer, go first."""

    def __init__(self, lane: Lane, priority: int = 0, decode_priority: int = 0,
                 prefill_sms: int | None = None):  # fmt: skip
        """``prefill_sms``: the SMs its prompt pieces run on while ``beside`` (None: all)."""
        self.lane, self.priority, self.decode_priority = lane, priority, decode_priority
        self.beside = False  # whether the engine's thread has requests decoding (it sets it)
        self._green = None  # (context, stream) of prefill_sms SMs; made here, where CUDA is
        if prefill_sms is not None and lane.runner.device.type == "cuda":  # current already
            self._green = green_stream(lane.runner.device, prefill_sms)
        self.error: BaseException | None = None  # what stopped the thread, if anything
        self.idle_event: torch.cuda.Event | None = None  # recorded when it last went idle
        self._commands: queue.Queue[Callable[[Lane], None] | None] = queue.Queue()
        self._outputs: list[RequestOutput] = []
        self._lock = threading.Lock()
        self._ready = threading.Event()  # outputs to take, or it went idle, or it stopped
        self._submitted = 0  # commands given (the engine's thread)
        self._idle_after = 0  # the commands it had applied when it last found nothing to do
        self._thread: threading.Thread | None = None
        self._stop = False

    def submit(self, command: Callable[[Lane], None]) -> None:
        """Run ``command(lane)`` on the worker between two of its steps."""
        if self.error is not None:
            raise RuntimeError(f"the {self.lane.name} lane stopped") from self.error
        with self._lock:
            self._submitted += 1
            self._ready.clear()
        self._commands.put(command)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"lane-{self.lane.name}",
                                            daemon=True)  # fmt: skip
            self._thread.start()

    @property
    def done(self) -> bool:
        """Whether it is idle and every output of its steps was taken."""
        with self._lock:
            return self._idle_after == self._submitted and not self._outputs

    @property
    def idle(self) -> bool:
        """Whether it has applied every command and found nothing left to do (its lane holds
        no request, no page, and no token is on its way)."""
        with self._lock:
            return self._idle_after == self._submitted

    def take(self) -> list[RequestOutput]:
        """The outputs of its steps since the last call, in order (raises what stopped it)."""
        with self._lock:
            outputs, self._outputs = self._outputs, []
            if not outputs and self._idle_after != self._submitted and self.error is None:
                self._ready.clear()
        if self.error is not None and not outputs:
            raise RuntimeError(f"the {self.lane.name} lane stopped") from self.error
        return outputs

    def wait(self, timeout: float) -> None:
        """Until it has outputs, goes idle or stops (at most ``timeout`` seconds)."""
        self._ready.wait(timeout)

    def close(self) -> None:
        """Stop the thread after the step it is in (its lane's requests are left as they
        are)."""
        self._stop = True
        if self._thread is not None:
            self._commands.put(None)
            self._thread.join(timeout=60)

    def _run(self) -> None:
        streams = None
        if self.lane.runner.device.type == "cuda":
            device = self.lane.runner.device
            prefill = torch.cuda.Stream(device, priority=self.priority)
            decode = prefill
            if self.decode_priority != self.priority:
                decode = torch.cuda.Stream(device, priority=self.decode_priority)
            confined = prefill if self._green is None else self._green[1]
            streams = (prefill, decode, confined)
        try:
            with torch.inference_mode(), torch.cuda.stream(streams and streams[0]):
                self._loop(streams)
        except BaseException as error:  # noqa: BLE001 (the engine's thread raises it)
            self.error = error
            self._ready.set()

    def _loop(self, streams: tuple | None) -> None:
        applied = 0
        while not self._stop:
            applied += self._apply_commands(block=False)
            if self.lane.has_unfinished():
                if streams is not None:
                    _switch(self._stream(*streams))
                outputs = self.lane.step()
                if outputs:
                    with self._lock:
                        self._outputs += outputs
                        self._ready.set()
                continue
            self._went_idle(applied)
            applied += self._apply_commands(block=True)

    def _stream(self, prefill, decode, confined) -> torch.cuda.Stream:
        decoding = self.lane.prefilling() is None and not self.lane.scheduler.waiting
        return step_stream(decoding, self.beside, prefill, decode, confined)

    def _apply_commands(self, block: bool) -> int:
        """Run the queued commands (waiting a while for one with ``block``); their count."""
        count = 0
        try:
            command = self._commands.get(timeout=IDLE_WAIT_S) if block else \
                self._commands.get_nowait()  # fmt: skip
        except queue.Empty:
            return count
        while True:
            if command is None:  # close()
                self._stop = True
                return count
            command(self.lane)
            count += 1
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return count

    def _went_idle(self, applied: int) -> None:
        if self.lane.runner.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self.idle_event = event
        with self._lock:
            self._idle_after = applied
            self._ready.set()


def step_stream(decoding: bool, beside: bool, prefill, decode, confined):
    """The stream of the lane's next step: a decode step's, else a prompt piece's, confined
    to part of the SMs while the engine's thread decodes ``beside`` it."""
    if decoding:
        return decode
    return confined if beside else prefill


def confined_sms(num_sms: int, share: float) -> int | None:
    """The SMs of ``num_sms`` that a prompt piece beside decoding requests runs on:
    ``share`` of them in whole groups of ``GREEN_SM_STEP`` (one at least); None where that
    is all of them."""
    if share >= 1:
        return None
    count = max(GREEN_SM_STEP, int(num_sms * share) // GREEN_SM_STEP * GREEN_SM_STEP)
    return count if count < num_sms else None


def green_stream(device: torch.device, num_sms: int) -> tuple[object, torch.cuda.Stream] | None:
    """``(context, stream)``: a stream whose kernels run on ``num_sms`` of the device's SMs
    (a CUDA green context; the context must outlive the stream's use); None, with a warning,
    where this torch or driver has none."""
    try:
        from torch.cuda.green_contexts import GreenContext

        index = device.index if device.index is not None else torch.cuda.current_device()
        context = GreenContext.create(num_sms=num_sms, device_id=index)
        return context, context.Stream()  # (torch 2.11 on; before it, no stream of its own)
    except Exception as error:  # noqa: BLE001 (any failure: the prompt keeps every SM)
        warnings.warn(f"prompt pieces keep every SM beside decoding requests: no CUDA green "
                      f"context here ({type(error).__name__}: {error})", stacklevel=2)  # fmt: skip
        return None


def _switch(stream: torch.cuda.Stream) -> None:
    """Make ``stream`` the thread's current one, after all work queued on the one before
    (so the lane's work stays in order). The allocator keeps freed blocks per stream: the
    cached ones go back first, so that two streams' blocks never add up past the budget
    (freeing them synchronises the device: once per prompt, and with ``prefill_sms`` each
    time the engine's thread starts or stops decoding beside a prompt)."""
    current = torch.cuda.current_stream()
    if current != stream:
        stream.wait_stream(current)
        torch.cuda.set_stream(stream)
        with DEVICE_LOCK:  # (no capture on another thread meanwhile)
            torch.cuda.empty_cache()


__all__ = ["GREEN_SM_STEP", "LaneWorker", "confined_sms", "green_stream", "step_stream"]
