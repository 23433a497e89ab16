import asyncio

from pydantic import BaseModel

from aggregates import Aggregate, Application, DomainError, DomainEvent, applies


class Opened(DomainEvent):  # an event: a frozen pydantic model, stored as JSON
    owner: str


class Deposited(DomainEvent):
    amount: int


class AccountState(BaseModel):
    owner: str = ""
    balance: int = 0


class Account(Aggregate[AccountState], category="Account"):  # stored on subjects events.Account.<id>
    def open(self, owner: str) -> None:
        self.record(Opened(owner=owner))

    def deposit(self, amount: int) -> None:  # a command: check the rules, then record what happened
        if amount <= 0:
            raise DomainError("Deposit a positive amount.")
        self.record(Deposited(amount=amount))

    @applies(Opened)  # state changes only here, when an event is recorded or replayed
    def _opened(self, event: Opened) -> None:
        self.state.owner = event.owner

    @applies(Deposited)
    def _deposited(self, event: Deposited) -> None:
        self.state.balance += event.amount


class Bank(Application):
    async def open_account(self, account_id: str, owner: str) -> None:
        await self.repository(Account).execute(account_id, lambda a: a.open(owner), create=True)

    async def deposit(self, account_id: str, amount: int, command_id: str) -> int:
        # the command id makes a resend harmless: it is applied once, at any age
        result = await self.repository(Account).execute(account_id, lambda a: a.deposit(amount), command_id=command_id)
        return result.version


async def main() -> None:
    async with Bank.connect() as bank:  # NATS_URL's server, or an embedded one (it says so)
        await bank.open_account("alice", "Alice")
        await bank.deposit("alice", 10, command_id="dep-1")
        await bank.deposit("alice", 10, command_id="dep-1")  # a resend: nothing new is stored
        alice = await bank.repository(Account).get("alice")
        print(alice.state, "version", alice.version)  # owner='Alice' balance=10 version 2


asyncio.run(main())
