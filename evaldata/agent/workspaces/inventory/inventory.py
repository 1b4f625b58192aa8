"""An in-memory inventory of items with quantities and unit prices (in cents)."""


class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, qty, price_cents):
        if qty <= 0:
            raise ValueError("qty must be positive")
        old_qty, _ = self.items.get(name, (0, price_cents))
        self.items[name] = (old_qty + qty, price_cents)

    def remove(self, name, qty):
        have, price = self.items[name]
        if qty > have:
            raise ValueError(f"only {have} of {name} left")
        self.items[name] = (have - qty, price)

    def total_cents(self):
        return sum(q * p for q, p in self.items.values())
