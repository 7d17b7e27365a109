"""Overload handling: objectives and priorities, saturation-aware admission, and flow
control (requests held in the picker by priority band and fairness flow until a pod has
room). The queue logic is pure and clock-injected; only `edge` touches asyncio."""
