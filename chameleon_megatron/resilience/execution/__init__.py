"""Running a layout megatron's parallel state cannot express, as a trainer step engine."""
