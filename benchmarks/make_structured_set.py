"""Writes src/flashdraft/benchdata/structured.jsonl: the structured-output benchmark set of `flashdraft bench`.

Each record is a chat prompt with the OpenAI `response_format` (or `tools` and `tool_choice`) it is decoded under:
  math      the first 8 GSM8K test questions (shipped beside it, MIT), answered as {"reasoning", "answer"}
  extract   8 short texts written for this set, their facts extracted into a schema's fields
  classify  4 reviews written for this set, labelled with an enum and a number
  object    4 requests for any JSON object (`json_object`)
  tools     6 requests for a tool call (OpenAI `tools`, `tool_choice` "required" or a named function)
Run it from the repository root: python benchmarks/make_structured_set.py
"""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path("src/flashdraft/benchdata")


def schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": required or list(properties),
            "additionalProperties": False}  # fmt: skip


MATH = schema_format("solution", obj({"reasoning": {"type": "string"}, "answer": {"type": "number"}}))
PERSON = schema_format("person", obj({"name": {"type": "string"}, "age": {"type": "integer"},
                                      "city": {"type": "string"}, "job": {"type": "string"}}))  # fmt: skip
ORDER = schema_format("order", obj({
    "customer": {"type": "string"},
    "items": {"type": "array", "items": obj({"product": {"type": "string"}, "quantity": {"type": "integer"},
                                             "unit_price": {"type": "number"}})},
    "total": {"type": "number"},
}))  # fmt: skip
EVENT = schema_format("event", obj({"title": {"type": "string"},
                                    "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                                    "location": {"type": "string"},
                                    "attendees": {"type": "array", "items": {"type": "string"}}}))  # fmt: skip
REVIEW = schema_format("review", obj({"sentiment": {"enum": ["positive", "negative", "mixed"]},
                                      "score": {"type": "integer", "minimum": 1, "maximum": 5},
                                      "summary": {"type": "string"}}))  # fmt: skip

TEXTS = [
    (PERSON, "Maria Keller, 34, moved from Hamburg to Lisbon last spring, where she now works as a nurse."),
    (PERSON, "At 58, the carpenter Tom Okafor still opens his workshop in Leeds every morning at six."),
    (PERSON, "Priya Nair is a 27-year-old software engineer who lives in Pune and cycles to work."),
    (ORDER, "Order from Dana White: 3 notebooks at $2.50 each, 1 backpack at $40 and 2 pens at $1.25 each."),
    (ORDER, "Ken Ito bought 4 coffee mugs for 8 dollars each and a teapot for 25 dollars."),
    (
        EVENT,
        "The spring science fair takes place on 14 March 2026 in the school gym; Ana, Ben and Chloe present.",
    ),
    (EVENT, "Team offsite: 2026-09-03 at the Lakeside Hotel, with Omar, Lucy, Raj and Mei attending."),
    (EVENT, "The book club meets on the first of June 2026 at Rosa's flat; Rosa and Jim will be there."),
]
REVIEWS = [
    "The headphones sound great and the battery lasts for days. Best purchase this year.",
    "Arrived broken, and support never answered my emails. Avoid.",
    "The hotel room was clean and the staff were kind, but the street noise kept us awake all night.",
    "Decent pasta, slow service, fair prices. I might come back.",
]
OBJECTS = [
    "List three fruits and their colors as a JSON object.",
    "Give a JSON object describing a fictional cat: its name, age, favourite food and whether it likes water.",
    "Return a JSON object mapping the first five planets of the solar system to their order from the sun.",
    "Describe today's weather in a made-up city as a JSON object.",
]


def tool(name: str, description: str, properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": obj(properties, required)}}  # fmt: skip


TIME_AND_WEATHER = [
    tool("get_weather", "The current weather in a city.",
         {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}),
    tool("get_time", "The local time in a time zone.", {"timezone": {"type": "string"}}),
]  # fmt: skip
SHOP = [
    tool("search_products", "Search the shop's catalogue.",
         {"query": {"type": "string"}, "max_price": {"type": "number"}}),
    tool("add_to_cart", "Add a product to the cart.",
         {"product_id": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1}}),
]  # fmt: skip
OFFICE = [
    tool("create_event", "Put an event in the calendar.",
         {"title": {"type": "string"}, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
          "attendees": {"type": "array", "items": {"type": "string"}}}),
    tool("send_email", "Send an email.", {"to": {"type": "string"}, "subject": {"type": "string"},
                                          "body": {"type": "string"}}),
]  # fmt: skip
NAMED = {"add_to_cart": {"type": "function", "function": {"name": "add_to_cart"}},
         "create_event": {"type": "function", "function": {"name": "create_event"}}}  # fmt: skip
TOOL_PROMPTS = [
    (TIME_AND_WEATHER, "required", "What is the weather like in Lisbon right now, in celsius?"),
    (TIME_AND_WEATHER, "required", "What time is it in Tokyo?"),
    (SHOP, "required", "Find me running shoes for under 80 dollars."),
    (SHOP, NAMED["add_to_cart"], "Put two of product A-113 in my cart."),
    (OFFICE, NAMED["create_event"], "Schedule a team lunch on 2026-12-04 with Ana and Ben."),
    (OFFICE, "required", "Email Omar that the quarterly report will be a day late."),
]


def main() -> None:
    records = []
    with open(DATA / "gsm8k_test.jsonl") as f:
        questions = [json.loads(line)["question"] for _, line in zip(range(8), f, strict=False)]
    for i, q in enumerate(questions):
        prompt = f"{q}\nReply in JSON with your step-by-step reasoning and the final numeric answer."
        records.append({"id": f"math-{i}", "category": "math", "turns": [prompt], "response_format": MATH})
    for i, (fmt, text) in enumerate(TEXTS):
        name = fmt["json_schema"]["name"]
        prompt = f"Extract the {name} from this text as JSON.\n\n{text}"
        records.append(
            {"id": f"extract-{i}", "category": "extract", "turns": [prompt], "response_format": fmt}
        )
    for i, text in enumerate(REVIEWS):
        prompt = f"Classify this review and summarise it in one sentence, as JSON.\n\n{text}"
        records.append(
            {"id": f"classify-{i}", "category": "classify", "turns": [prompt], "response_format": REVIEW}
        )
    for i, prompt in enumerate(OBJECTS):
        records.append({"id": f"object-{i}", "category": "object", "turns": [prompt],
                        "response_format": {"type": "json_object"}})  # fmt: skip
    for i, (tools, choice, prompt) in enumerate(TOOL_PROMPTS):
        records.append({"id": f"tools-{i}", "category": "tools", "turns": [prompt], "tools": tools,
                        "tool_choice": choice})  # fmt: skip
    with open(DATA / "structured.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    print(f"wrote {len(records)} records to {DATA / 'structured.jsonl'}")


if __name__ == "__main__":
    main()
