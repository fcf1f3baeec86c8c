"""The Stage gRPC service: takes each hop's stream, batches across sessions, streams results onward."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Generator
from dataclasses import replace
from typing import Any

import grpc
import torch
from google.protobuf.message import DecodeError

from stratamesh.agent import kv_transfer
from stratamesh.agent.engine.scheduler import Batch
from stratamesh.agent.engine.stage_engine import Outbox, StageEngine
from stratamesh.agent.engine.stage_runner import StepOutput
from stratamesh.agent.engine.tp_group import GroupFailed
from stratamesh.agent.observer import StageObserver
from stratamesh.agent.stages import StageHost
from stratamesh.fleet.errors import InvalidInput, MeshError, StageFailed
from stratamesh.fleet.logs import trace_context
from stratamesh.fleet.tracing import parse_traceparent
from stratamesh.fleet.sessions import (SessionClose, SessionHold, SessionOpen, SessionRewind, StepBatch, StepChunk,
                                       StepChunks, TokenEvent)
from stratamesh.fleet.wire import convert
from stratamesh.fleet.wire import mesh_pb2 as pb
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire.rtc import DataChannel
from stratamesh.fleet.wire.stream import OutboundStream, RtcDialer, StreamPool
from stratamesh.kernels import codec

log = logging.getLogger(__name__)

# Every step runs on the event loop's thread: torch's CPU kernels run about a quarter slower when a second
# Python thread drives them (each calling thread gets an OpenMP pool of its own, and the loop's thread would
# also take the GIL from the runner). A step that runs longer than this lets the loop serve its other work
# (messages arriving, heartbeats, KV moves) between two layers.
YIELD_EVERY_S = 0.02


class _Poison:
    """Stands in the inbox for a message that failed validation, or a lost hop: fails its session in order."""

    def __init__(self, session_id: str, exc: MeshError, unreachable: str = ""):
        self.session_id = session_id
        self.exc = exc
        self.unreachable = unreachable     # the next hop's address, when that is what was lost


class _Call:
    """Stands in the inbox for work on the engines that must run between steps (a KV export or import); with
    ready, it waits for the first point between steps where ready() holds."""

    def __init__(self, fn: Callable[[], Any], ready: Callable[[], bool] | None = None):
        self.fn = fn
        self.ready = ready
        self.done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def run(self) -> None:
        if self.done.cancelled():
            return      # the RPC that asked is gone: nobody wants it done
        try:
            self.done.set_result(self.fn())
        except Exception as exc:  # the RPC that asked answers with it
            self.done.set_exception(exc)


Inbound = (SessionOpen | StepChunk | StepChunks | StepBatch | SessionClose | SessionHold | SessionRewind | _Poison
           | _Call)
# a message, when it arrived (Unix ns), and the assignment it is for ("": the stage its session is open on here)
Arrival = tuple[Inbound, int, str]


class StageService(pb_grpc.StageServicer):
    """Applies inbound messages in arrival order between steps; one step at a time per agent."""

    def __init__(self, host: StageHost, agent_id: str, observer: StageObserver | None = None,
                 rtc_dialer: RtcDialer | None = None):
        """rtc_dialer: how to reach a next stage behind NAT (None: over gRPC like any other)."""
        self._host = host
        self._agent_id = agent_id
        self.observer = observer or StageObserver(agent_id)
        self._inbox: asyncio.Queue[Arrival] = asyncio.Queue()
        self._next_stages = StreamPool(lambda ch, it: pb_grpc.StageStub(ch).Push(it),
                                       on_broken=self._next_broken, rtc_dialer=rtc_dialer)
        self._channels: set[asyncio.Task[int]] = set()      # data channels from peers, each read by a task
        self._origins = StreamPool(lambda ch, it: pb_grpc.OriginStub(ch).Deliver(it),
                                   on_broken=self._origin_broken)
        self._worker: asyncio.Task[None] | None = None
        self._waiting: list[_Call] = []     # calls between steps waiting for a step to ready them
        # the address peers dial for this service, once bound: a stage that fails as a whole (a tensor-parallel
        # group went down) names it as the hop its sessions lost, so that their origins fail over around it
        self.address = ""

    def start(self) -> None:
        self._worker = asyncio.get_running_loop().create_task(self._work())

    def inbox_depth(self) -> int:
        """Messages received and not yet applied."""
        return self._inbox.qsize()

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
        for task in list(self._channels):
            task.cancel()
        await self._next_stages.close()
        await self._origins.close()

    # ------------------------------------------------------------ gRPC
    async def Push(self, request_iterator: AsyncIterator[pb.StageMessage],
                   context: grpc.aio.ServicerContext) -> pb.PushSummary:
        return pb.PushSummary(num_messages=await self._take(request_iterator, "grpc", context.peer().rsplit(":", 1)[0]))

    def take_channel(self, channel: DataChannel) -> None:
        """Takes the messages of a data channel from a peer (one outside this agent's NAT) as Push takes a stream's."""
        async def messages() -> AsyncIterator[pb.StageMessage]:
            async for data in channel.messages():
                message = pb.StageMessage()
                try:
                    message.ParseFromString(data)
                except DecodeError:
                    log.warning("dropped a data-channel message from %s that is not a StageMessage", channel.peer_id)
                    continue
                yield message

        async def take() -> int:
            try:
                return await self._take(messages(), "webrtc", channel.peer_id)
            finally:
                await channel.close()

        task = asyncio.get_running_loop().create_task(take())
        self._channels.add(task)
        task.add_done_callback(self._channels.discard)

    async def _take(self, messages: AsyncIterator[pb.StageMessage], transport: str, peer: str) -> int:
        """Puts each message from a previous hop in the inbox, in order; returns how many came."""
        num_messages = 0
        opened: dict[str, str] = {}     # session -> its assignment here, of the sessions opened over this stream
        received = self.observer.receiving(peer, transport)
        try:
            async for message in messages:
                num_messages += 1
                received()
                try:
                    inbound = convert.stage_message_from_pb(message)
                except InvalidInput as exc:
                    self._reject(message, exc)
                    continue
                if isinstance(inbound, SessionOpen):
                    opened[inbound.session_id] = inbound.assignment_id
                elif isinstance(inbound, SessionClose):
                    opened.pop(inbound.session_id, None)
                self._inbox.put_nowait((inbound, time.time_ns(), message.to))
        finally:
            # The previous hop is gone (or done): nothing more can arrive for its sessions, so they end here
            # and downstream instead of holding KV blocks until this agent stops.
            for session_id, assignment_id in opened.items():
                self._inbox.put_nowait((SessionClose(session_id), 0, assignment_id))
        return num_messages

    async def Info(self, request: pb.StageInfoRequest, context: grpc.aio.ServicerContext) -> pb.StageInfo:
        host = self._host
        return convert.stage_info_to_pb(self._agent_id, host.assignments(), host.tensor_names(),
                                        host.param_bytes(), host.num_sessions)

    async def Trace(self, request: pb.TraceRequest, context: grpc.aio.ServicerContext) -> pb.TraceSpans:
        return convert.spans_to_pb(self.observer.spans.trace(request.trace_id))

    async def ExportKv(self, request: pb.KvExportRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.KvChunk]:
        try:
            export = convert.kv_export_request_from_pb(request)
            engine = self._host.engine(export.assignment_id)
            layout = engine.kv_layout()
            kv_transfer.check_export(layout, export)
            # a hand-off asks as the prefill starts: the export waits for the step that completes the prompt here
            ready = (lambda: engine.prefilled(export.session_id)) if export.wait_for_prefill else None
            header, data = kv_transfer.seal(layout, await self._between_steps(
                lambda: engine.export_session(export.session_id), ready))
        except MeshError as exc:
            await context.abort(kv_transfer.status_of(exc), str(exc))
        yield convert.kv_chunk_to_pb(header)
        for piece in kv_transfer.pieces(data):
            yield convert.kv_chunk_to_pb(piece)
        # Every piece is out: the session lives on at the importer, and leaves quietly here.
        await self._between_steps(lambda: engine.drop(export.session_id))
        self.observer.kv_moved("export", len(data))
        log.info("session %s exported (%d tokens, %d bytes)", export.session_id, header.num_computed, len(data))

    async def ImportKv(self, request: pb.KvImportRequest,
                       context: grpc.aio.ServicerContext) -> pb.KvImportSummary:
        try:
            pull = convert.kv_import_request_from_pb(request)
            engine = self._host.engine(pull.assignment_id)
            session, summary = await kv_transfer.pull(pull, engine.kv_layout())
            await self._between_steps(lambda: engine.import_session(session))
        except MeshError as exc:
            await context.abort(kv_transfer.status_of(exc), str(exc))
        asyncio.get_running_loop().call_later(kv_transfer.PARK_S, self._unpark, engine, pull.session_id)
        self.observer.kv_moved("import", summary.num_bytes)
        log.info("session %s imported from %s (%d tokens, %d bytes)", pull.session_id, pull.source.address,
                 summary.num_tokens, summary.num_bytes)
        return convert.kv_import_summary_to_pb(summary)

    async def _between_steps(self, fn: Callable[[], Any], ready: Callable[[], bool] | None = None) -> Any:
        """Runs fn on the worker between steps, where the engines may change (once ready() holds there, if given),
        and returns what it did."""
        call = _Call(fn, ready)
        self._inbox.put_nowait((call, 0, ""))
        return await call.done

    def _unpark(self, engine: StageEngine, session_id: str) -> None:
        def free() -> None:
            if engine.unpark(session_id):
                log.info("imported session %s was never resumed: freed", session_id)

        self._inbox.put_nowait((_Call(free), 0, ""))

    # ------------------------------------------------------------ worker
    async def _work(self) -> None:
        # Inference mode for as long as the worker runs (it is a thread's state, so other tasks of the loop run in it
        # too: nothing in an agent computes gradients), not re-entered for every step, or every layer of one.
        with torch.inference_mode():
            while True:
                self._apply(*await self._inbox.get())
                while True:
                    self._drain()
                    await self._coalesce()
                    if not await self._step():
                        break
                    await asyncio.sleep(0)      # the loop sends the step's results and takes what arrived

    def _drain(self) -> None:
        waiting, self._waiting = self._waiting, []
        for call in waiting:        # calls that waited for a step: the one just run may have readied them
            self._apply(call, 0, "")
        while not self._inbox.empty():
            self._apply(*self._inbox.get_nowait())

    async def _coalesce(self) -> None:
        """Waits briefly while decodes of the coming step are still arriving one by one from the origin."""
        engines = [e for e in self._host.engines.values() if e.wants_more_decodes()]
        if not engines:
            return
        deadline = asyncio.get_running_loop().time() + self._host.config.coalesce_s
        while any(e.wants_more_decodes() for e in engines):
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return
            try:
                self._apply(*await asyncio.wait_for(self._inbox.get(), remaining))
            except asyncio.TimeoutError:
                return
            self._drain()

    def _apply(self, message: Inbound, arrived_ns: int, to: str) -> None:
        if isinstance(message, _Call):
            if message.ready is not None and not message.done.cancelled() and not message.ready():
                self._waiting.append(message)
            else:
                message.run()
            return
        outbox = Outbox()
        try:
            match message:
                case SessionOpen():
                    self._next_stages.learn(message.route + ((message.feed,) if message.feed else ()))
                    with trace_context(parse_traceparent(message.traceparent)[0]):
                        self._host.engine(message.assignment_id).open(message, outbox)
                        log.debug("session %s opened on %s (%d prompt tokens)", message.session_id,
                                  message.assignment_id, len(message.prompt_token_ids))
                case StepChunk():
                    self._add_chunk(message, arrived_ns, to)
                case StepChunks():
                    self._add_chunks(message, arrived_ns, to)
                case StepBatch():
                    self._add_batch(message, arrived_ns, to)
                case SessionClose():
                    engine = self._host.engine_of(message.session_id, to)
                    if engine is not None:
                        engine.close(message.session_id, outbox)
                case SessionHold():
                    engine = self._host.engine_of(message.session_id, to)
                    if engine is not None:
                        engine.hold(message.session_id, outbox)
                case SessionRewind():
                    engine = self._host.engine_of(message.session_id, to)
                    if engine is not None:
                        engine.rewind(message, outbox)
                case _Poison():
                    self._fail(message.session_id, message.exc, outbox, message.unreachable, to)
        except MeshError as exc:
            if isinstance(message, SessionOpen) and self._host.engine_of(message.session_id,
                                                                         message.assignment_id) is None:
                self._refuse_open(message, exc, outbox)
            else:
                self._fail(_session_of(message), exc, outbox, to=to)
        self._send(outbox)

    def _add_chunk(self, chunk: StepChunk, arrived_ns: int, to: str) -> None:
        engine = self._engine_of(chunk.session_id, to)
        engine.add(chunk, None, arrived_ns)
        self.observer.arrived(engine, chunk, arrived_ns, chunk.sent_unix_ns)

    def _add_chunks(self, message: StepChunks, arrived_ns: int, to: str) -> None:
        """Each chunk on its own: a bad one fails its session, not the others."""
        for chunk in message.chunks:
            try:
                self._add_chunk(chunk, arrived_ns, to)
            except MeshError as exc:
                outbox = Outbox()
                self._fail(chunk.session_id, exc, outbox, to=to)
                self._send(outbox)

    def _add_batch(self, batch: StepBatch, arrived_ns: int, to: str) -> None:
        try:
            hidden, row = codec.decode(batch.hidden), 0   # [sum of chunk lengths, hidden]
        except MeshError as exc:
            outbox = Outbox()
            for chunk in batch.chunks:
                self._fail(chunk.session_id, exc, outbox, to=to)
            self._send(outbox)
            return
        for chunk in batch.chunks:
            rows = hidden[row:row + len(chunk.token_ids)]
            row += len(chunk.token_ids)
            try:
                engine = self._engine_of(chunk.session_id, to)
                if rows.shape[1] != engine.runner.model.config.hidden_size:
                    raise InvalidInput(f"batch.hidden has {rows.shape[1]} columns, expected "
                                       f"{engine.runner.model.config.hidden_size}")
                engine.add(chunk, rows, arrived_ns)
                self.observer.arrived(engine, chunk, arrived_ns, batch.sent_unix_ns)
            except MeshError as exc:
                outbox = Outbox()
                self._fail(chunk.session_id, exc, outbox, to=to)
                self._send(outbox)

    def _engine_of(self, session_id: str, to: str) -> StageEngine:
        engine = self._host.engine_of(session_id, to)
        if engine is None:
            raise InvalidInput(f"session_id {session_id!r} is not open here")
        return engine

    async def _step(self) -> bool:
        """Runs one batch on every engine that has work; False when none could run."""
        ran = False
        for engine in list(self._host.engines.values()):
            batch = engine.schedule()
            if batch is None:
                continue
            start_ns = time.time_ns()
            output = await self._run(engine, batch) if batch.chunks else None
            end_ns = time.time_ns()
            if output is not None:
                engine.timed(batch, (end_ns - start_ns) / 1e9, end_ns)
                self._host.num_computed_tokens += sum(c.num_tokens for c in batch.chunks)
                self._host.num_step_tokens += len(batch.chunks)
                self.observer.stepped(engine, batch, start_ns, end_ns)
            self.observer.preempted(engine, len(batch.preempted))
            outbox = Outbox()
            try:
                if output is not None or not batch.chunks:
                    engine.postprocess(batch, output, outbox)
                    self.observer.verified(engine, batch)
                self._send(outbox, sent_ns=end_ns)
                if engine.is_last and output is not None:
                    outbox = Outbox()
                    engine.follow(outbox)           # the runs that follow those just sent into the pipeline
                    self._send(outbox)
            except Exception as exc:    # a bug: the step's sessions fail, saying why, and the stage serves on
                log.exception("after a step of %s", engine.assignment.assignment_id)
                outbox = Outbox()
                for chunk in batch.chunks:
                    self._fail(chunk.session_id, StageFailed(f"{type(exc).__name__}: {exc}"), outbox,
                               to=engine.assignment.assignment_id)
                self._send(outbox)
            ran = ran or bool(batch.chunks)
        return ran

    async def _run(self, engine: StageEngine, batch: Batch):
        try:
            return await _between_layers(engine.run_steps(batch), self._host)
        except Exception as exc:  # a failed step fails its sessions; only a group's failure fails the stage
            log.exception("a step of %s failed", engine.assignment.assignment_id)
            lost = self.address if isinstance(exc, GroupFailed) else ""
            outbox = Outbox()
            for chunk in batch.chunks:
                self._fail(chunk.session_id, StageFailed(f"{type(exc).__name__}: {exc}"), outbox, unreachable=lost)
            engine.postprocess(batch, None, outbox)
            self._send(outbox)
            return None

    # ------------------------------------------------------------ sending
    def _send(self, outbox: Outbox, sent_ns: int = 0) -> None:
        """Sends what a step or message produced; sent_ns stamps a step's results with when it finished."""
        for hop, message in outbox.stage_messages:
            if sent_ns and isinstance(message, StepBatch):
                message = replace(message, sent_unix_ns=sent_ns)
            if hop.address == self.address:     # a stage here too: the first of a pipeline fed here, or the next
                self._inbox.put_nowait((message, time.time_ns(), hop.assignment_id))
                continue
            coded = "" if not isinstance(message, StepBatch) else (
                message.hidden.dtype if message.hidden.codec == "raw" else message.hidden.codec)
            self._send_to(self._next_stages, hop.address, convert.stage_message_to_pb(message, hop.assignment_id),
                          coded)
        by_origin: dict[str, list[TokenEvent]] = {}
        for origin, event in outbox.events:
            by_origin.setdefault(origin, []).append(replace(event, sent_unix_ns=sent_ns) if sent_ns else event)
        for origin, events in by_origin.items():
            self._send_to(self._origins, origin, convert.token_batch_to_pb(events))

    def _send_to(self, pool: StreamPool, address: str, message: pb.StageMessage | pb.TokenBatch,
                 codec: str = "") -> None:
        try:
            stream = pool.get(address)
            stream.send(message)
        except MeshError as exc:
            log.warning("could not send to %s: %s", address, exc)
            return
        self.observer.sent(address, message.ByteSize(), codec, stream.transport)

    # ------------------------------------------------------------ failures
    def _fail(self, session_id: str, exc: BaseException, outbox: Outbox, unreachable: str = "", to: str = "") -> None:
        """Ends the session here (on the stage of assignment to, if given) and downstream, and tells its origin why
        (and which hop was lost, if one was)."""
        engine = self._host.engine_of(session_id, to) if session_id else None
        message = engine.close(session_id, outbox) if engine is not None else None
        if message is None:   # it ended here (closed, or preempted) while a step of it was on its way
            log.debug("dropped a message for unknown session %s: %s", session_id, exc)
            return
        with trace_context(parse_traceparent(message.traceparent)[0]):
            log.warning("session %s failed on %s: %s", session_id, self._agent_id, exc)
        outbox.events.append((message.origin, TokenEvent(session_id, -1, error=str(exc),
                                                         error_stage=self._agent_id, unreachable=unreachable)))

    def _refuse_open(self, message: SessionOpen, exc: MeshError, outbox: Outbox) -> None:
        """Tells the origin why a session could not open here (a prompt outside the vocabulary, a stage not served
        here), so that it fails now rather than after its step timeout; the stages before close it as it ends."""
        log.warning("session %s could not open on %s: %s", message.session_id, self._agent_id, exc)
        outbox.events.append((message.origin, TokenEvent(message.session_id, -1, error=str(exc),
                                                         error_stage=self._agent_id)))

    def _next_broken(self, stream: OutboundStream, exc: BaseException | None) -> None:
        """Fails, in order, every session whose next hop (or, on the last stage, the first stage its decode loop
        feeds) was on the broken stream."""
        for session_id, message in self._open_sessions():
            next_hop = message.route[0] if message.route else message.feed
            if next_hop is not None and next_hop.address == stream.address:
                self._inbox.put_nowait((_Poison(session_id, StageFailed(str(exc)), stream.address), 0,
                                        message.assignment_id))

    def _origin_broken(self, stream: OutboundStream, exc: BaseException | None) -> None:
        """Ends every session whose origin can no longer be reached: nobody would take its tokens."""
        for session_id, message in self._open_sessions():
            if message.origin == stream.address:
                self._inbox.put_nowait((SessionClose(session_id), 0, message.assignment_id))

    def _open_sessions(self) -> list[tuple[str, SessionOpen]]:
        """(session id, its open message) of every session open on any stage here."""
        return [item for engine in self._host.engines.values() for item in engine.sessions.items()]

    def _reject(self, message: pb.StageMessage, exc: InvalidInput) -> None:
        known = [s for s in convert.session_ids_of(message) if s and self._host.engine_of(s, message.to) is not None]
        for session_id in known:
            self._inbox.put_nowait((_Poison(session_id, exc), 0, message.to))
        if not known:
            log.info("rejected a stage message: %s", exc)


async def _between_layers(steps: Generator[None, None, StepOutput], host: StageHost) -> StepOutput:
    """Runs a step's layers on this thread, letting the event loop run whenever YIELD_EVERY_S has passed; adds
    the process CPU time they took to host.layers_cpu_s (what the loop does in between is the serving path's)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + YIELD_EVERY_S
    while True:
        started = time.process_time()
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        finally:
            host.layers_cpu_s += time.process_time() - started
        if loop.time() >= deadline:
            await asyncio.sleep(0)
            deadline = loop.time() + YIELD_EVERY_S


def _session_of(message: Inbound) -> str:
    return "" if isinstance(message, StepBatch | StepChunks) else message.session_id
