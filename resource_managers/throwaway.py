"""Throwaway PostgreSQL clusters and Redis servers, started from local binaries: a public testing
helper.

Why it is public and lives here: an application that enlists PostgreSQL or Redis in twopc
transactions needs the same thing twopc's own suite needs to test it honestly — a real server it may
``kill -9`` and restart on the same data, configured for two-phase commit — and nothing else in the
ecosystem starts one without Docker. It imports only the standard library, and nothing of twopc, so
it costs a library user nothing. `twopc demo`, the test suite and the benchmarks use it;
`docs/operations.md` ("Testing your own code") shows it. Each server gets a private data directory,
a free port on 127.0.0.1 and settings fit for two-phase commit (``max_prepared_transactions`` > 0,
``fsync=on``; Redis with ``appendonly yes`` + ``appendfsync always``). Every server runs in its own
process group, so `kill9` takes down the postmaster *and* its backends at once, as a machine crash
would; `restart` then starts it again on the same data directory, which is what crash tests need to
prove that a prepared transaction or a staged write survived.

Running as root, PostgreSQL refuses to start (initdb says why), so the cluster is created and run
as the ``postgres`` user when there is one. The binaries are looked up on PATH and in Debian's
``/usr/lib/postgresql/<version>/bin``; `find_postgres_bin` and `find_redis_server` say where, or
None, so callers can explain what to install.

Why one module: it is a self-contained testing helper that imports only the standard library, so a
user can read (or copy) it whole; the two servers share one process base.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import psycopg2

INSTALL_HINT = (
    "install the servers (Debian/Ubuntu: apt-get install postgresql redis-server) or point "
    "TWOPC_TEST_POSTGRES_URL / TWOPC_TEST_REDIS_URL at running servers"
)


S = TypeVar("S", bound="_Process")


class ServerError(RuntimeError):
    """A throwaway server could not be started or stopped; the message carries its log tail."""


def find_postgres_bin() -> Path | None:
    """The directory holding ``initdb`` and ``postgres``, newest Debian version first."""
    on_path = shutil.which("initdb")
    if on_path and (Path(on_path).resolve().parent / "postgres").exists():
        return Path(on_path).resolve().parent
    candidates = sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
        reverse=True,
    )
    for candidate in candidates:
        if (candidate / "initdb").exists() and (candidate / "postgres").exists():
            return candidate
    return None


def find_redis_server() -> Path | None:
    found = shutil.which("redis-server")
    return Path(found) if found else None


def free_port() -> int:
    """A port nobody listens on right now (the usual race with other processes is accepted)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_as() -> tuple[int, int] | None:
    """(uid, gid) of ``postgres`` when we are root, since PostgreSQL refuses to run as root."""
    if os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam("postgres")
    except KeyError as exc:
        raise ServerError("running as root, but there is no 'postgres' user to run as") from exc
    return entry.pw_uid, entry.pw_gid


def _chown_tree(path: Path, owner: tuple[int, int] | None) -> None:
    if owner is None:
        return
    for root, dirs, files in os.walk(path):
        os.chown(root, *owner)
        for name in [*dirs, *files]:
            os.lchown(os.path.join(root, name), *owner)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _wait_port(port: int, proc: subprocess.Popen[bytes], log: Path, what: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerError(f"{what} exited with {proc.returncode}:\n{_tail(log)}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.02)
    raise ServerError(f"{what} did not listen on port {port} within 60 s:\n{_tail(log)}")


class _Process:
    """One server process in its own process group; the base of both server kinds."""

    what = "server"

    def __init__(self, directory: Path, port: int) -> None:
        self.directory = directory
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self: S) -> S:
        raise NotImplementedError

    def restart(self: S) -> S:
        """Start again on the same data directory (after `kill9`, PostgreSQL runs crash recovery
        and Redis replays its AOF)."""
        if self.running:
            self.stop()
        return self.start()

    def __enter__(self: S) -> S:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def remove(self) -> None:
        """Stop and delete the data directory."""
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _spawn(self, argv: list[str], log: Path, owner: tuple[int, int] | None) -> None:
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a process group of its own: kill9 takes every child
                user=owner[0] if owner else None,
                group=owner[1] if owner else None,
            )
        _wait_port(self.port, self.proc, log, f"{self.what} on port {self.port}")

    def kill9(self) -> None:
        """SIGKILL the server and every process it started, then reap them: a crash, not a stop."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._wait_group_gone(self.proc.pid)
        self.proc = None

    def stop(self, timeout: float = 30.0) -> None:
        """A clean shutdown (SIGINT: PostgreSQL's fast mode), escalating to `kill9` if it hangs."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGINT if self.what == "postgres" else signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill9()
            return
        self._wait_group_gone(self.proc.pid)
        self.proc = None

    @staticmethod
    def _wait_group_gone(pgid: int) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.01)

    def pause(self) -> None:
        """SIGSTOP the whole server: it holds its connections but answers nothing."""
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGCONT)


class PostgresServer(_Process):
    """A private PostgreSQL cluster on 127.0.0.1 with two-phase commit enabled.

    ``template`` is the data directory of a stopped, freshly initialised cluster to copy instead
    of running ``initdb`` again (a copy takes a tenth of the time).
    """

    what = "postgres"

    def __init__(
        self,
        directory: Path | None = None,
        *,
        bindir: Path | None = None,
        port: int | None = None,
        max_prepared_transactions: int = 64,
        template: Path | None = None,
        settings: dict[str, str] | None = None,
    ) -> None:
        found = bindir or find_postgres_bin()
        if found is None:
            raise ServerError(f"no PostgreSQL binaries (initdb, postgres) found; {INSTALL_HINT}")
        self.bindir = found
        self.owner = _run_as()
        if directory is None:
            directory = Path(tempfile.mkdtemp(prefix="twopc-pg-"))
        super().__init__(directory, port or free_port())
        self.datadir = directory / "data"
        self.max_prepared_transactions = max_prepared_transactions
        self.settings = settings or {}
        self._template = template

    # -- lifecycle -------------------------------------------------------------------------------

    def initialise(self) -> PostgresServer:
        """Create the cluster's files without starting it (a template for `PostgresServer`)."""
        if not (self.datadir / "PG_VERSION").exists():
            self._init()
        return self

    def start(self) -> PostgresServer:
        self.initialise()
        self._configure()
        argv = [str(self.bindir / "postgres"), "-D", str(self.datadir)]
        self._spawn(argv, self.directory / "server.log", self.owner)
        self._wait_accepting()
        return self

    def _init(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        _chown_tree(self.directory, self.owner)
        if self._template is not None:
            shutil.copytree(self._template, self.datadir, symlinks=True)
            _chown_tree(self.datadir, self.owner)
            os.chmod(self.datadir, 0o700)
            return
        argv = [
            str(self.bindir / "initdb"),
            "-D",
            str(self.datadir),
            "-U",
            "postgres",
            "-A",
            "trust",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
        ]
        done = subprocess.run(
            argv,
            capture_output=True,
            user=self.owner[0] if self.owner else None,
            group=self.owner[1] if self.owner else None,
        )
        if done.returncode != 0:
            raise ServerError(f"initdb failed: {done.stderr.decode(errors='replace')}")

    def _configure(self) -> None:
        settings = {
            "listen_addresses": "'127.0.0.1'",
            "port": str(self.port),
            "unix_socket_directories": "''",
            "max_prepared_transactions": str(self.max_prepared_transactions),
            "max_connections": "100",
            "fsync": "on",
            "synchronous_commit": "on",
            "shared_buffers": "32MB",
            "logging_collector": "off",
            **self.settings,
        }
        # postgresql.auto.conf is read last, so these win over anything a template carried
        text = "".join(f"{key} = {value}\n" for key, value in settings.items())
        auto = self.datadir / "postgresql.auto.conf"
        auto.write_text(text)
        if self.owner:
            os.chown(auto, *self.owner)

    def _wait_accepting(self) -> None:
        """The port opens before crash recovery ends; wait until a query really answers."""
        deadline = time.monotonic() + 60
        while True:
            try:
                psycopg2.connect(self.dsn("postgres"), connect_timeout=2).close()
                return
            except psycopg2.OperationalError as exc:
                if time.monotonic() > deadline or not self.running:
                    raise ServerError(
                        f"postgres on port {self.port} does not accept connections: {exc}\n"
                        f"{_tail(self.directory / 'server.log')}"
                    ) from exc
                time.sleep(0.05)

    # -- databases -------------------------------------------------------------------------------

    def dsn(self, database: str = "postgres") -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={database}"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str | None = None) -> str:
        """A fresh, empty database (from template0 for speed and no surprises); returns its name."""
        name = name or f"t_{uuid.uuid4().hex[:12]}"
        _admin(self.dsn("postgres"), f'CREATE DATABASE "{name}" TEMPLATE template0')
        return name

    def drop_database(self, name: str) -> None:
        """Drop a database, first rolling back what is still prepared in it (a test's leftovers)."""
        drop_database(self.dsn("postgres"), self.dsn(name), name)


def _admin(dsn: str, *statements: str) -> list[tuple[object, ...]]:
    conn = psycopg2.connect(dsn, connect_timeout=10)
    try:
        conn.autocommit = True
        rows: list[tuple[object, ...]] = []
        with conn.cursor() as cur:
            for statement in statements:
                cur.execute(statement)
                if cur.description is not None:
                    rows = cur.fetchall()
        return rows
    finally:
        conn.close()


def drop_database(admin_dsn: str, database_dsn: str, name: str) -> None:
    """Roll back every prepared transaction of ``name``, end its sessions, and drop it.

    A prepared transaction pins its database (DROP DATABASE refuses) and can only be finished from
    inside it, hence the second DSN.
    """
    try:
        gids = _admin(
            database_dsn,
            "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()",
        )
    except psycopg2.OperationalError:
        gids = []
    for (gid,) in gids:
        with contextlib.suppress(psycopg2.Error):
            _admin(database_dsn, f"ROLLBACK PREPARED '{str(gid).replace(chr(39), chr(39) * 2)}'")
    _admin(admin_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class RedisServer(_Process):
    """A private ``redis-server`` that persists every write before answering (AOF, always)."""

    what = "redis"

    def __init__(
        self,
        directory: Path | None = None,
        *,
        binary: Path | None = None,
        port: int | None = None,
        appendonly: bool = True,
        appendfsync: str = "always",
        extra: list[str] | None = None,
    ) -> None:
        found = binary or find_redis_server()
        if found is None:
            raise ServerError(f"no redis-server binary found; {INSTALL_HINT}")
        self.binary = found
        if directory is None:
            directory = Path(tempfile.mkdtemp(prefix="twopc-redis-"))
        super().__init__(directory, port or free_port())
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.extra = extra or []

    def start(self) -> RedisServer:
        argv = [
            str(self.binary),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.directory),
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            self.appendfsync,
            "--save",
            "",
            "--maxmemory-policy",
            "noeviction",
            "--daemonize",
            "no",
            "--logfile",
            "",
            *self.extra,
        ]
        self._spawn(argv, self.directory / "server.log", None)
        return self

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"
