def format_report(inv):
    lines = [f"{name}: {qty} x {price / 100:.2f}" for name, (qty, price) in sorted(inv.items.items())]
    lines.append(f"total: {inv.total_cents() / 100:.2f}")
    return "\n".join(lines)
