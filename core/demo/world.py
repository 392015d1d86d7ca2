"""The demo model's small world: what it knows (capitals, metric units) and the two tools it can call.

The tool functions are deterministic stand-ins (the same city always gets the same weather and clock), so
the demo works offline and its answers can be checked against what the tools returned. The chat page gets
the same two tools with the same schemas (the model sees the prompt it was trained on), made to show the
page's questions: one waits for the user's approval, the other asks the user (:data:`DEMO_PAGE_TOOLS`).
"""

from __future__ import annotations

import hashlib
import json

from ..tools import Tool, ToolContext, tool

CAPITALS: dict[str, str] = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "the United Kingdom": "London", "Ireland": "Dublin", "the Netherlands": "Amsterdam",
    "Belgium": "Brussels", "Switzerland": "Bern", "Austria": "Vienna", "Poland": "Warsaw",
    "Czechia": "Prague", "Hungary": "Budapest", "Greece": "Athens", "Sweden": "Stockholm", "Norway": "Oslo",
    "Denmark": "Copenhagen", "Finland": "Helsinki", "Iceland": "Reykjavik", "Russia": "Moscow",
    "Ukraine": "Kyiv", "Romania": "Bucharest", "Bulgaria": "Sofia",
    "Serbia": "Belgrade", "Croatia": "Zagreb", "Slovakia": "Bratislava", "Slovenia": "Ljubljana",
    "Estonia": "Tallinn", "Latvia": "Riga", "Lithuania": "Vilnius", "Luxembourg": "Luxembourg",
    "Malta": "Valletta", "Albania": "Tirana", "Georgia": "Tbilisi", "Armenia": "Yerevan",
    "Azerbaijan": "Baku",
    "Belarus": "Minsk", "Turkey": "Ankara", "Egypt": "Cairo", "Morocco": "Rabat", "Algeria": "Algiers",
    "Tunisia": "Tunis", "Libya": "Tripoli", "Nigeria": "Abuja", "Kenya": "Nairobi", "Ethiopia": "Addis Ababa",
    "Ghana": "Accra", "Senegal": "Dakar", "Uganda": "Kampala", "Rwanda": "Kigali", "Zambia": "Lusaka",
    "Zimbabwe": "Harare", "Angola": "Luanda", "Mozambique": "Maputo", "Namibia": "Windhoek",
    "Botswana": "Gaborone", "Madagascar": "Antananarivo", "Mali": "Bamako", "Sudan": "Khartoum",
    "China": "Beijing", "Japan": "Tokyo", "South Korea": "Seoul", "North Korea": "Pyongyang",
    "India": "New Delhi", "Pakistan": "Islamabad", "Bangladesh": "Dhaka", "Nepal": "Kathmandu",
    "Thailand": "Bangkok", "Vietnam": "Hanoi", "Cambodia": "Phnom Penh", "Laos": "Vientiane",
    "Indonesia": "Jakarta", "the Philippines": "Manila", "Malaysia": "Kuala Lumpur", "Singapore": "Singapore",
    "Mongolia": "Ulaanbaatar", "Iran": "Tehran", "Iraq": "Baghdad", "Saudi Arabia": "Riyadh",
    "Jordan": "Amman", "Lebanon": "Beirut", "Syria": "Damascus", "Afghanistan": "Kabul",
    "Kazakhstan": "Astana", "Uzbekistan": "Tashkent", "Qatar": "Doha", "Oman": "Muscat",
    "the United States": "Washington, D.C.", "Canada": "Ottawa", "Mexico": "Mexico City", "Cuba": "Havana",
    "Jamaica": "Kingston", "Panama": "Panama City", "Costa Rica": "San Jose", "Brazil": "Brasilia",
    "Argentina": "Buenos Aires", "Chile": "Santiago", "Peru": "Lima", "Colombia": "Bogota",
    "Venezuela": "Caracas", "Ecuador": "Quito", "Uruguay": "Montevideo", "Australia": "Canberra",
    "New Zealand": "Wellington", "Fiji": "Suva",
}

OTHER_CITIES = (
    "New York", "Los Angeles", "Chicago", "San Francisco", "Toronto", "Vancouver", "Montreal", "Sydney",
    "Melbourne", "Auckland", "Mumbai", "Bangalore", "Shanghai", "Hong Kong", "Osaka", "Kyoto", "Busan",
    "Istanbul", "Dubai", "Barcelona", "Munich", "Hamburg", "Milan", "Naples", "Venice", "Lyon", "Marseille",
    "Zurich", "Geneva", "Porto", "Seville", "Krakow", "Edinburgh", "Manchester", "Rio de Janeiro",
    "Sao Paulo", "Cape Town", "Lagos", "Casablanca", "Marrakesh",
)

CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "snowy", "foggy", "stormy", "clear", "overcast", "drizzly")

# (unit, plural, target unit plural, factor): conversions that append zeros, learnable digit by digit.
CONVERSIONS = (
    ("kilometer", "kilometers", "meters", 1000),
    ("meter", "meters", "centimeters", 100),
    ("meter", "meters", "millimeters", 1000),
    ("centimeter", "centimeters", "millimeters", 10),
    ("kilogram", "kilograms", "grams", 1000),
    ("liter", "liters", "milliliters", 1000),
)


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def weather_report(city: str) -> dict[str, object]:
    """The stand-in weather of ``city``: the same city always gets the same report."""
    h = _digest("weather:" + city.strip().lower())
    return {"city": city, "temperature_c": h % 46 - 10, "condition": CONDITIONS[(h >> 8) % len(CONDITIONS)]}


def clock_report(city: str) -> dict[str, object]:
    """The stand-in local time of ``city``."""
    h = _digest("time:" + city.strip().lower())
    return {"city": city, "time": f"{h % 24:02d}:{(h >> 8) % 60:02d}"}


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city.

    Args:
        city: Name of the city.
    """
    return json.dumps(weather_report(city), ensure_ascii=False)


@tool
def get_time(city: str) -> str:
    """Get the current local time in a city.

    Args:
        city: Name of the city.
    """
    return json.dumps(clock_report(city), ensure_ascii=False)


DEMO_TOOLS = (get_weather, get_time)
"""The demo tools as a terminal runs them: automatically (``generate --tools demo``, ``chat --tools demo``)."""


def _get_time_of_the_city_the_user_means(city: str, context: ToolContext) -> str:
    """Get the current local time in a city.

    Args:
        city: Name of the city.
    """
    answer = context.request_input(f"Which {city}? Add the country or region, or leave it empty for the "
                                   "best-known one.")
    return get_time(" ".join(answer.split()) or city)


DEMO_PAGE_TOOLS = (Tool(get_weather.fn, needs_approval=True),
                   Tool(_get_time_of_the_city_the_user_means, name="get_time"))
"""The demo tools as the chat page runs them (``serve --tools demo``, ``chat --web --tools demo``): the
weather waits for the user's approval (Approve, edit the arguments, or Deny with a reason), and the time
first asks the user which city they mean (an input request). Their schemas are :data:`DEMO_TOOLS`'."""
