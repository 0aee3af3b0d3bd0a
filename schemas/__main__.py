"""`python -m schemas`: re-export the JSON Schema files under schemas/json/."""

from schemas.export import write_schemas

for path in write_schemas():
    print(path)
