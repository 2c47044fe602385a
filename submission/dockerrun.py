"""Run a container with a real stdin pipe through the docker SDK.

`containers.run()` cannot feed stdin, and the WMT interface is stdin→stdout,
so this attaches to the container's streams before it starts (no output is
lost), writes stdin over the hijacked socket and half-closes it for EOF.
`Session` is the interactive form (latency tests); `run()` feeds a whole input
from a thread while reading, so inputs larger than the pipe buffers work.

    from submission.dockerrun import run
    r = run("wmt-kit:latest", ["/run.sh", "CPU-1", "throughput"], b"Hello\\n")
    r.exit_code, r.stdout, r.stderr
"""
from __future__ import annotations

import queue
import socket
import struct
import threading
from dataclasses import dataclass

DEFAULT_LIMITS = dict(network_mode="none", mem_limit="2g", memswap_limit="2g")


@dataclass
class Result:
    exit_code: int
    stdout: bytes
    stderr: bytes
    oom_killed: bool


class Session:
    """A started container: write() to its stdin, read its stdout as it comes."""

    def __init__(self, image: str, command: list[str] | None = None, client=None,
                 volumes: dict | None = None, nano_cpus: int | None = None, **limits):
        import docker
        self.client = client or docker.from_env()
        api = self.client.api
        host = api.create_host_config(**{**DEFAULT_LIMITS, **limits}, binds=volumes, nano_cpus=nano_cpus)
        self.id = api.create_container(image, command, stdin_open=True, host_config=host)["Id"]
        self._sock = api.attach_socket(self.id, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1})
        self._raw = getattr(self._sock, "_sock", self._sock)
        self.stdout_chunks: queue.Queue[bytes | None] = queue.Queue()
        self._err = bytearray()
        self._reader = threading.Thread(target=self._demux, daemon=True)
        self._reader.start()
        api.start(self.id)

    def _recv_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            b = self._raw.recv(n - len(buf))
            if not b:
                return bytes(buf)
            buf += b
        return bytes(buf)

    def _demux(self) -> None:
        # Without a TTY docker multiplexes: 8-byte header (stream, 0, 0, 0, size BE32).
        try:
            while True:
                head = self._recv_exact(8)
                if len(head) < 8:
                    break
                stream, size = head[0], struct.unpack(">I", head[4:])[0]
                data = self._recv_exact(size)
                if stream == 2:
                    self._err += data
                else:
                    self.stdout_chunks.put(data)
        except OSError:
            pass
        self.stdout_chunks.put(None)

    def write(self, data: bytes) -> None:
        self._raw.sendall(data)

    def close_stdin(self) -> None:
        self._raw.shutdown(socket.SHUT_WR)

    def read_until(self, n_newlines: int, timeout: float) -> bytes:
        """stdout until it holds n_newlines, or TimeoutError: the latency contract."""
        got = bytearray()
        while got.count(b"\n") < n_newlines:
            try:
                chunk = self.stdout_chunks.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no answer in {timeout} s; stderr so far: {bytes(self._err)[-500:]!r}")
            if chunk is None:
                break
            got += chunk
        return bytes(got)

    def wait(self, timeout: float = 600) -> Result:
        out = bytearray()
        while True:
            chunk = self.stdout_chunks.get(timeout=timeout)
            if chunk is None:
                break
            out += chunk
        return self.finish(bytes(out), timeout)

    def finish(self, stdout: bytes, timeout: float = 600) -> Result:
        api = self.client.api
        code = api.wait(self.id, timeout=timeout)["StatusCode"]
        self._reader.join(timeout=10)
        oom = bool(api.inspect_container(self.id)["State"].get("OOMKilled"))
        self.remove()
        return Result(code, stdout, bytes(self._err), oom)

    def remove(self) -> None:
        import docker
        try:
            self._sock.close()
            self.client.api.remove_container(self.id, force=True)
        except docker.errors.NotFound:
            pass


def run(image: str, command: list[str] | None = None, stdin: bytes = b"", timeout: float = 600,
        **kw) -> Result:
    s = Session(image, command, **kw)
    try:
        def feed():
            try:
                s.write(stdin)
                s.close_stdin()
            except OSError:  # the container exited early (bad model): its exit code says why
                pass
        writer = threading.Thread(target=feed, daemon=True)
        writer.start()
        return s.wait(timeout)
    finally:
        s.remove()
