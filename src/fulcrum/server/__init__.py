"""The HTTP layer: Starlette routes over the `Service` facade."""
