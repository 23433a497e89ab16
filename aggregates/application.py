"""An application: the event store, a repository per aggregate class, and your command methods, in one object.

::

    class Bank(Application):
        async def open_account(self, owner: str) -> str:
            account_id = new_id()
            await self.repository(Account).execute(account_id, lambda a: a.open(owner), create=True)
            return account_id

    async with Bank.connect() as bank:                # settings from NATS_URL, JETSOURCING_STREAM, ...
        alice = await bank.open_account("Alice")

The dog school of pyeventsourcing's documentation, written this way, is in
``tests/aggregates/test_application.py``.
"""

from __future__ import annotations

import uuid
from collections.abc import Generator
from types import TracebackType
from typing import Any, Generic, TypeVar

from eventstore import EventLog, EventStore, EventStoreSettings, InMemoryEventStore, InvalidArgumentError

from .aggregate import Aggregate
from .repository import Repository
from .service import CommandService

__all__ = ["Application", "new_id"]

A = TypeVar("A", bound=Aggregate[Any])
App = TypeVar("App", bound="Application")


def new_id() -> str:
    """A new aggregate id: a random UUID (version 4), as text."""
    return str(uuid.uuid4())


class Application:
    """Owns an :class:`~eventstore.EventStore` (and so its type registry) and one repository per aggregate class.

    Subclass it and add your command methods; build it around a connected
    store, or with :meth:`connect`, which also closes the store on exit.
    ``repository_options`` (``cache_size``, ``snapshot_every``, ``retry``, ...)
    apply to every repository it makes; :meth:`repository` takes its own.
    """

    def __init__(self, store: EventLog, **repository_options: Any) -> None:
        if not isinstance(store, (EventStore, InMemoryEventStore)):
            raise InvalidArgumentError(
                f"An Application needs a connected EventStore (or, in tests, an InMemoryEventStore), not {store!r:.80}."
            )
        self.store = store
        self._options = repository_options
        self._repositories: dict[type[Aggregate[Any]], Repository[Any]] = {}
        self._owns_store = False

    @classmethod
    def connect(cls: type[App], settings: EventStoreSettings | None = None, **repository_options: Any) -> _Connecting[App]:
        """Connect an event store (``settings``, else the environment) and build the application around it.

        Await it, or use it as an async context manager that closes the store.
        """
        return _Connecting(cls, settings, repository_options)

    def repository(self, aggregate_type: type[A], **options: Any) -> Repository[A]:
        """The repository of ``aggregate_type``, made on first use (its event types registered in the store)."""
        repository = self._repositories.get(aggregate_type)
        if repository is None:
            if not (isinstance(aggregate_type, type) and issubclass(aggregate_type, Aggregate)):
                raise InvalidArgumentError(f"repository() takes an Aggregate class, not {aggregate_type!r:.80}.")
            repository = Repository(self.store, aggregate_type, **{**self._options, **options})
            self._repositories[aggregate_type] = repository
        elif options:
            raise InvalidArgumentError(
                f"The repository of {aggregate_type.__name__} exists already; give its options on first use."
            )
        return repository

    def command_service(self, **options: Any) -> CommandService:
        """A :class:`CommandService` on this application's store (``options`` go to it); add the commands.

        Commands travel over NATS: the store must be an :class:`~eventstore.EventStore`.
        """
        if not isinstance(self.store, EventStore):
            raise InvalidArgumentError("Commands are served over NATS: command_service() needs an EventStore, not "
                                       f"{type(self.store).__name__}.")
        return CommandService(self.store, **options)

    async def close(self) -> None:
        """Close the event store, if :meth:`connect` opened it."""
        if self._owns_store:
            await self.store.close()


class _Connecting(Generic[App]):
    """What :meth:`Application.connect` returns: await it, or use it as an async context manager."""

    def __init__(self, cls: type[App], settings: EventStoreSettings | None, options: dict[str, Any]) -> None:
        self._cls, self._settings, self._options = cls, settings, options
        self._app: App | None = None

    async def _open(self) -> App:
        store = await EventStore.connect(self._settings or EventStoreSettings())
        try:
            app = self._cls(store, **self._options)
        except BaseException:
            await store.close()  # a failed build leaves no connection (nor embedded server) behind
            raise
        app._owns_store = True
        return app

    def __await__(self) -> Generator[Any, None, App]:
        return self._open().__await__()

    async def __aenter__(self) -> App:
        self._app = await self._open()
        return self._app

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._app is not None:
            await self._app.close()
