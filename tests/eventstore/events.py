"""Event models shared by the event store tests."""

from pydantic import BaseModel


class Opened(BaseModel):
    owner: str


class Deposited(BaseModel):
    amount: int


class Note(BaseModel):
    text: str


ALL = (Opened, Deposited, Note)
