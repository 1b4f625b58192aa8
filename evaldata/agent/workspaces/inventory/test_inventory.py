from inventory import Inventory
from report import format_report

inv = Inventory()
inv.add("bolt", 10, 25)
inv.add("nut", 5, 10)
inv.remove("bolt", 4)
assert inv.total_cents() == 6 * 25 + 5 * 10
inv.remove("nut", 5)
assert "nut" not in format_report(inv), format_report(inv)
print("all tests passed")
