"""Example domains written against :mod:`aggregates`: a bank account, and a shopping cart that becomes an order.

Money is in integer cents. Each command checks its invariants and records
events; each ``@applies`` handler only changes state.
"""

from __future__ import annotations

from pydantic import BaseModel

from aggregates import Aggregate, DomainError, DomainEvent, applies

# -- bank account ---------------------------------------------------------------


class AccountOpened(DomainEvent):
    owner: str


class Deposited(DomainEvent):
    amount: int


class Withdrawn(DomainEvent):
    amount: int


class AccountClosed(DomainEvent):
    pass


class AccountState(BaseModel):
    owner: str = ""
    balance: int = 0
    open: bool = False
    closed: bool = False


class AccountError(DomainError):
    """A command on an account was refused."""


class InsufficientFunds(AccountError):
    def __init__(self, balance: int, amount: int) -> None:
        self.balance = balance
        self.amount = amount
        super().__init__(f"Cannot withdraw {amount}: the balance is only {balance} and overdrafts are not allowed.")


class Account(Aggregate[AccountState]):
    """A bank account without overdraft."""

    def open(self, owner: str) -> None:
        if self.state.open or self.state.closed:
            raise AccountError(f"Account {self.id!r} is already open.")
        if not owner:
            raise AccountError("An account needs an owner.")
        self.record(AccountOpened(owner=owner))

    def deposit(self, amount: int) -> int:
        self._check_usable(amount)
        self.record(Deposited(amount=amount))
        return self.state.balance

    def withdraw(self, amount: int) -> int:
        self._check_usable(amount)
        if amount > self.state.balance:
            raise InsufficientFunds(self.state.balance, amount)
        self.record(Withdrawn(amount=amount))
        return self.state.balance

    def close(self) -> None:
        if not self.state.open:
            raise AccountError(f"Account {self.id!r} is not open.")
        if self.state.balance:
            raise AccountError(f"Account {self.id!r} still holds {self.state.balance}; withdraw it first.")
        self.record(AccountClosed())

    def _check_usable(self, amount: int) -> None:
        if not self.state.open:
            raise AccountError(f"Account {self.id!r} is not open.")
        if amount <= 0:
            raise AccountError(f"Amounts must be positive, not {amount}.")

    @applies(AccountOpened)
    def _opened(self, event: AccountOpened) -> None:
        self.state.owner = event.owner
        self.state.open = True

    @applies(Deposited)
    def _deposited(self, event: Deposited) -> None:
        self.state.balance += event.amount

    @applies(Withdrawn)
    def _withdrawn(self, event: Withdrawn) -> None:
        self.state.balance -= event.amount

    @applies(AccountClosed)
    def _closed(self, event: AccountClosed) -> None:
        self.state.open = False
        self.state.closed = True


# -- shopping cart and order ----------------------------------------------------


class Line(BaseModel):
    sku: str
    quantity: int
    unit_price: int


class CartCreated(DomainEvent):
    customer: str


class ItemAdded(DomainEvent):
    sku: str
    quantity: int
    unit_price: int


class ItemRemoved(DomainEvent):
    sku: str


class CartCheckedOut(DomainEvent):
    order_id: str


class CartState(BaseModel):
    customer: str = ""
    lines: dict[str, Line] = {}
    checked_out: bool = False

    @property
    def total(self) -> int:
        return sum(line.quantity * line.unit_price for line in self.lines.values())


class CartError(DomainError):
    """A command on a cart or order was refused."""


class Cart(Aggregate[CartState], category="ShoppingCart"):
    """A shopping cart: add and remove items until it is checked out into an order."""

    def create(self, customer: str) -> None:
        if self.version:
            raise CartError(f"Cart {self.id!r} already exists.")
        self.record(CartCreated(customer=customer))

    def add_item(self, sku: str, quantity: int, unit_price: int) -> None:
        self._check_open()
        if quantity <= 0 or unit_price < 0:
            raise CartError(f"Cannot add {quantity} x {sku} at {unit_price}.")
        self.record(ItemAdded(sku=sku, quantity=quantity, unit_price=unit_price))

    def remove_item(self, sku: str) -> None:
        self._check_open()
        if sku not in self.state.lines:
            raise CartError(f"{sku} is not in cart {self.id!r}.")
        self.record(ItemRemoved(sku=sku))

    def check_out(self, order: Order) -> None:
        """Turn the cart into ``order`` (a new Order aggregate); save both with ``save_all``."""
        self._check_open()
        if not self.state.lines:
            raise CartError(f"Cart {self.id!r} is empty.")
        order.place(cart_id=self.id, customer=self.state.customer, lines=list(self.state.lines.values()))
        self.record(CartCheckedOut(order_id=order.id))

    def _check_open(self) -> None:
        if not self.version:
            raise CartError(f"Cart {self.id!r} does not exist.")
        if self.state.checked_out:
            raise CartError(f"Cart {self.id!r} is already checked out.")

    @applies(CartCreated)
    def _created(self, event: CartCreated) -> None:
        self.state.customer = event.customer

    @applies(ItemAdded)
    def _added(self, event: ItemAdded) -> None:
        line = self.state.lines.get(event.sku)
        quantity = event.quantity + (line.quantity if line else 0)
        self.state.lines[event.sku] = Line(sku=event.sku, quantity=quantity, unit_price=event.unit_price)

    @applies(ItemRemoved)
    def _removed(self, event: ItemRemoved) -> None:
        del self.state.lines[event.sku]

    @applies(CartCheckedOut)
    def _checked_out(self, event: CartCheckedOut) -> None:
        self.state.checked_out = True


class OrderPlaced(DomainEvent):
    cart_id: str
    customer: str
    lines: list[Line]
    total: int


class OrderPaid(DomainEvent):
    amount: int


class OrderShipped(DomainEvent):
    carrier: str


class OrderCancelled(DomainEvent):
    reason: str


class OrderState(BaseModel):
    customer: str = ""
    lines: list[Line] = []
    total: int = 0
    paid: int = 0
    status: str = "new"


class Order(Aggregate[OrderState]):
    """An order: placed from a cart, paid, then shipped, or cancelled before shipping."""

    def place(self, cart_id: str, customer: str, lines: list[Line]) -> None:
        if self.version:
            raise CartError(f"Order {self.id!r} was already placed.")
        total = sum(line.quantity * line.unit_price for line in lines)
        self.record(OrderPlaced(cart_id=cart_id, customer=customer, lines=lines, total=total))

    def pay(self, amount: int) -> None:
        if self.state.status != "placed":
            raise CartError(f"Order {self.id!r} is {self.state.status}; only placed orders are paid.")
        if amount != self.state.total - self.state.paid:
            raise CartError(f"Order {self.id!r} needs {self.state.total - self.state.paid}, not {amount}.")
        self.record(OrderPaid(amount=amount))

    def ship(self, carrier: str) -> None:
        if self.state.status != "paid":
            raise CartError(f"Order {self.id!r} is {self.state.status}; only paid orders ship.")
        self.record(OrderShipped(carrier=carrier))

    def cancel(self, reason: str) -> None:
        if self.state.status in ("shipped", "cancelled"):
            raise CartError(f"Order {self.id!r} is {self.state.status} and can no longer be cancelled.")
        self.record(OrderCancelled(reason=reason))

    @applies(OrderPlaced)
    def _placed(self, event: OrderPlaced) -> None:
        self.state.customer = event.customer
        self.state.lines = list(event.lines)
        self.state.total = event.total
        self.state.status = "placed"

    @applies(OrderPaid)
    def _paid(self, event: OrderPaid) -> None:
        self.state.paid += event.amount
        self.state.status = "paid"

    @applies(OrderShipped)
    def _shipped(self, event: OrderShipped) -> None:
        self.state.status = "shipped"

    @applies(OrderCancelled)
    def _cancelled(self, event: OrderCancelled) -> None:
        self.state.status = "cancelled"
