"""The word lists the rules verifier reads: number words, units, negators, antonym pairs, scope
groups, connectors that give roles an order, and a small gazetteer of names. Data only."""

from __future__ import annotations

NUMBER_WORDS: dict[str, float] = {
    "zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7,
    "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13,
    "fourteen": 14, "fifteen": 15, "sixteen": 16, "seventeen": 17, "eighteen": 18,
    "nineteen": 19, "twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60,
    "seventy": 70, "eighty": 80, "ninety": 90, "dozen": 12, "half": 0.5, "twice": 2,
}  # fmt: skip
MULTIPLIERS: dict[str, float] = {"hundred": 100, "thousand": 1e3, "million": 1e6, "billion": 1e9}

# Canonical unit -> surface forms (lower case). Currencies are units: "100 USD" vs "100 EUR"
# differ the way "5 km" and "5 miles" do. "pound" stands for both lb and GBP: telling them apart
# needs context the rules do not have, and a pair differing only there is rare.
_UNIT_FORMS: dict[str, tuple[str, ...]] = {
    "km": ("km", "kms", "kilometer", "kilometers", "kilometre", "kilometres"),
    "mile": ("mile", "miles", "mi"),
    "meter": ("meter", "meters", "metre", "metres"),
    "cm": ("cm", "centimeter", "centimeters", "centimetre", "centimetres"),
    "mm": ("mm", "millimeter", "millimeters", "millimetre", "millimetres"),
    "foot": ("foot", "feet", "ft"),
    "inch": ("inch", "inches", "in."),
    "yard": ("yard", "yards", "yd"),
    "kg": ("kg", "kgs", "kilo", "kilos", "kilogram", "kilograms"),
    "gram": ("g", "gram", "grams", "gr"),
    "mg": ("mg", "milligram", "milligrams"),
    "mcg": ("mcg", "microgram", "micrograms"),
    "pound": ("lb", "lbs", "pound", "pounds", "gbp", "£", "sterling", "quid"),
    "ounce": ("oz", "ounce", "ounces"),
    "ton": ("ton", "tons", "tonne", "tonnes"),
    "liter": ("l", "liter", "liters", "litre", "litres"),
    "ml": ("ml", "milliliter", "milliliters", "millilitre", "millilitres"),
    "gallon": ("gallon", "gallons", "gal"),
    "cup": ("cup", "cups"),
    "tbsp": ("tbsp", "tablespoon", "tablespoons"),
    "tsp": ("tsp", "teaspoon", "teaspoons"),
    "celsius": ("c", "°c", "celsius", "centigrade"),
    "fahrenheit": ("f", "°f", "fahrenheit"),
    "kelvin": ("kelvin",),
    "ms": ("ms", "millisecond", "milliseconds"),
    "second": ("sec", "secs", "second", "seconds"),
    "minute": ("min", "mins", "minute", "minutes"),
    "hour": ("h", "hr", "hrs", "hour", "hours"),
    "day": ("day", "days"),
    "week": ("week", "weeks", "wk", "wks"),
    "month": ("month", "months", "mo"),
    "year": ("year", "years", "yr", "yrs"),
    "kb": ("kb", "kilobyte", "kilobytes"),
    "mb": ("mb", "megabyte", "megabytes"),
    "gb": ("gb", "gig", "gigs", "gigabyte", "gigabytes"),
    "tb": ("tb", "terabyte", "terabytes"),
    "mbps": ("mbps",),
    "gbps": ("gbps",),
    "mph": ("mph",),
    "kmh": ("kmh", "kph", "km/h"),
    "percent": ("%", "percent", "percentage", "pct"),
    "watt": ("w", "watt", "watts"),
    "kw": ("kw", "kilowatt", "kilowatts"),
    "kwh": ("kwh",),
    "volt": ("v", "volt", "volts"),
    "calorie": ("cal", "kcal", "calorie", "calories"),
    "am": ("am", "a.m."),
    "pm": ("pm", "p.m."),
    "usd": ("usd", "$", "dollar", "dollars", "bucks", "us$"),
    "eur": ("eur", "€", "euro", "euros"),
    "jpy": ("jpy", "¥", "yen"),
    "cny": ("cny", "rmb", "yuan", "renminbi"),
    "inr": ("inr", "₹", "rupee", "rupees"),
    "cad": ("cad", "c$"),
    "aud": ("aud", "a$"),
    "chf": ("chf", "franc", "francs"),
    "mxn": ("mxn", "peso", "pesos"),
    "btc": ("btc", "bitcoin", "bitcoins"),
    "eth": ("eth", "ether", "ethereum"),
}
UNITS: dict[str, str] = {form: unit for unit, forms in _UNIT_FORMS.items() for form in forms}
# Short unit forms ("l", "am", "min", "mo") are units only right after a number ("5 l",
# "9 am"); alone they are other words. These short ones are units anywhere.
STANDALONE_SHORT_UNITS = frozenset({
    "km", "kms", "kg", "kgs", "cm", "mm", "ml", "lb", "lbs", "oz", "ft", "kb", "mb", "gb", "tb",
    "usd", "eur", "gbp", "jpy", "cny", "rmb", "inr", "cad", "aud", "chf", "mxn", "btc", "eth",
    "kwh", "mph", "kmh", "kph", "mcg", "$", "€", "£", "¥", "₹", "%", "°c", "°f",
})  # fmt: skip
STANDALONE_MIN_LEN = 4

NEGATORS = frozenset({
    "not", "no", "non", "never", "without", "none", "nobody", "nothing", "neither", "nor", "cannot",
    "cant", "dont", "doesnt", "didnt", "isnt", "arent", "wasnt", "werent", "wont", "wouldnt",
    "shouldnt", "couldnt", "hasnt", "havent", "hadnt", "mustnt", "aint", "unable", "lack",
    "lacks", "lacking", "fail", "fails", "failed", "failing", "stopped", "refuses", "refuse",
})  # fmt: skip
# Prefixes that negate the word they start ("unsafe", "illegal", "dislike", "non-toxic"); a
# prefixed word counts as a negation only when the other text holds its stem, so "inexpensive"
# against "cheap" is left to the antonym table, not read as "not expensive".
NEGATING_PREFIXES = ("non", "un", "in", "im", "il", "ir", "dis")
MIN_STEM_LEN = 4

# Each pair: two sides of base forms; inflections are generated (s, es, ed, ing, doubling).
ANTONYMS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (("increase", "raise", "grow", "boost"), ("decrease", "reduce", "shrink", "cut", "lower")),
    (("buy", "purchase", "bought"), ("sell", "sold")),
    (("import",), ("export",)),
    (("add", "insert", "attach"), ("remove", "delete", "detach", "drop")),
    (("enable", "activate", "turn on", "switch on"), ("disable", "deactivate", "turn off")),
    (("open",), ("close", "shut")),
    (("start", "begin", "launch"), ("stop", "end", "finish", "quit")),
    (("win", "won"), ("lose", "lost")),
    (("hot", "warm", "heat"), ("cold", "cool", "chill")),
    (("cheap", "inexpensive", "affordable"), ("expensive", "pricey", "costly")),
    (("high",), ("low",)),
    (("fast", "quick", "speed up"), ("slow", "slow down")),
    (("best",), ("worst",)),
    (("better",), ("worse",)),
    (("upload",), ("download",)),
    (("arrive", "arrival", "arrivals", "land", "landing"), ("depart", "departure", "departures")),
    (("login", "log in", "sign in", "signin"), ("logout", "log out", "sign out", "signout")),
    (("encrypt", "encryption"), ("decrypt", "decryption")),
    (("deposit",), ("withdraw", "withdrawal")),
    (("credit",), ("debit",)),
    (("push",), ("pull",)),
    (("long",), ("short",)),
    (("early",), ("late",)),
    (("accept", "approve", "allow", "permit"), ("reject", "deny", "decline", "block", "forbid")),
    (("include",), ("exclude",)),
    (("input",), ("output",)),
    (("public",), ("private",)),
    (("left",), ("right",)),
    (("north", "northern"), ("south", "southern")),
    (("east", "eastern"), ("west", "western")),
    (("gain", "put on"), ("lose", "loss")),
    (("ascending", "asc"), ("descending", "desc")),
    (("inbound", "incoming"), ("outbound", "outgoing")),
    (("up", "upgrade"), ("down", "downgrade")),
    (("true",), ("false",)),
    (("male", "men", "man"), ("female", "women", "woman")),
    (("adult", "adults"), ("child", "children", "kid", "kids")),
    (("light", "lightweight"), ("heavy", "heavyweight")),
    (("safe",), ("dangerous", "risky", "harmful")),
    (("legal",), ("illegal",)),
    (("strong", "stronger"), ("weak", "weaker")),
    (("big", "bigger", "large", "larger"), ("small", "smaller", "little")),
    (("wide", "wider"), ("narrow", "narrower")),
    (("rich",), ("poor",)),
    (("wet",), ("dry",)),
    (("full",), ("empty",)),
    (("new", "newer"), ("old", "older")),
    (("light", "bright"), ("dark",)),
    (("hire", "hiring"), ("fire", "firing", "lay off")),
    (("profit",), ("loss",)),
    (("bull", "bullish"), ("bear", "bearish")),
    (("lend", "lending"), ("borrow", "borrowing")),
    (("send", "sent"), ("receive", "received")),
    (("pay",), ("refund", "get paid")),
    (("compress", "zip"), ("decompress", "extract", "unzip")),
    (("serialize", "encode"), ("deserialize", "decode", "parse")),
    (("lock",), ("unlock",)),
    (("mount",), ("unmount",)),
    (("install",), ("uninstall",)),
    (("subscribe",), ("unsubscribe",)),
    (("follow",), ("unfollow",)),
    (("block",), ("unblock",)),
    (("uppercase", "upper case", "capitalize"), ("lowercase", "lower case")),
    (("inside", "indoor", "indoors"), ("outside", "outdoor", "outdoors")),
    (("domestic",), ("international",)),
    (("vegetarian", "vegan"), ("meat",)),
    (("hypertension", "high blood pressure"), ("hypotension", "low blood pressure")),
    (("overdose",), ("underdose",)),
    (("overweight",), ("underweight",)),
    (("positive",), ("negative",)),
    (("sweet",), ("sour", "bitter", "savory")),
)

# Scope groups: a word gives its group a value. Texts differing in a group's values differ in
# scope; for the groups in STRICT_SCOPE, a value on one side and none on the other counts too
# ("flights before 9am" is not "flights at 9am"), while "all" against nothing is a paraphrase.
SCOPE: dict[str, tuple[str, str]] = {
    **{w: ("quantity", "all") for w in ("all", "every", "each", "everything", "everyone",
                                        "entire", "whole", "always")},
    **{w: ("quantity", "some") for w in ("some", "few", "several", "part", "partial",
                                         "sometimes", "occasionally")},
    "at least": ("bound", "min"), "at most": ("bound", "max"), "up to": ("bound", "max"),
    "most": ("quantity", "most"),
    **{w: ("extreme", "min") for w in ("min", "minimum", "lowest", "least", "smallest",
                                       "cheapest", "fewest", "minimal", "minimize")},
    **{w: ("extreme", "max") for w in ("max", "maximum", "highest", "largest", "biggest",
                                       "maximal", "maximize", "priciest")},
    **{w: ("compare", "more") for w in ("more", "over", "above", "greater", "exceeding",
                                        "exceeds", "beyond", "longer", "higher")},
    **{w: ("compare", "less") for w in ("less", "under", "below", "fewer", "within", "shorter",
                                        "lower")},
    **{w: ("time", "before") for w in ("before", "prior", "earlier", "pre", "until", "till",
                                       "by")},
    **{w: ("time", "after") for w in ("after", "later", "post", "since", "from")},
    **{w: ("rank", "first") for w in ("first", "earliest", "oldest", "initial")},
    **{w: ("rank", "last") for w in ("last", "latest", "newest", "final", "recent")},
    **{w: ("day", w) for w in ("today", "tonight", "tomorrow", "yesterday", "weekend",
                               "weekday", "weekdays")},
    **{w: ("period", w.removesuffix("ly")) for w in ("hourly", "daily", "weekly", "monthly",
                                                      "yearly", "quarterly")},
    "annual": ("period", "year"), "annually": ("period", "year"), "per year": ("period", "year"),
    "per month": ("period", "month"), "per day": ("period", "dai"), "per week": ("period", "week"),
}  # fmt: skip
STRICT_SCOPE = frozenset({"extreme", "compare", "time", "day", "period"})
# Groups whose one-sided value means little in a question ("from" often just marks a source).
SCOPE_TWO_SIDED_ONLY = frozenset({("time", "after"), ("time", "before"), ("compare", "more"),
                                  ("compare", "less")})  # fmt: skip

# Connectors that give the terms around them roles: "USD to EUR", "Paris to Rome", "tea than
# coffee". `from` points the other way ("to Rome from Paris" = "from Paris to Rome").
FORWARD_CONNECTORS = frozenset({"to", "into", "than", "over", "->", "→", "before", "per", "by",
                                "onto", "towards"})  # fmt: skip
BACKWARD_CONNECTORS = frozenset({"from", "after"})
UNIT_ONLY_CONNECTORS = frozenset({"in", "as"})  # "100 usd in eur": a conversion only between units
COMPARATIVE_WORDS = frozenset({"better", "worse", "more", "less", "rather", "faster", "slower"})

# Names the capital letter cannot find in lower-case text. Small on purpose: capitalised words
# are found by their case; this holds what people type in lower case.
GAZETTEER = frozenset({
    # places
    "paris", "rome", "london", "berlin", "madrid", "tokyo", "beijing", "delhi", "mumbai",
    "dubai", "sydney", "toronto", "chicago", "boston", "seattle", "austin", "denver", "miami",
    "nyc", "sf", "france", "italy", "spain", "germany", "japan", "china", "india",
    "canada", "mexico", "brazil", "uk", "usa", "europe", "asia", "africa", "australia",
    "lisbon", "barcelona", "amsterdam", "vienna", "prague", "athens", "istanbul", "cairo",
    "bangkok", "singapore", "seoul", "osaka", "kyoto", "milan", "venice", "florence", "dublin",
    "edinburgh", "munich", "zurich", "geneva", "brussels", "oslo", "stockholm", "copenhagen",
    "helsinki", "warsaw", "budapest", "lima", "bogota", "vancouver", "montreal", "atlanta",
    "dallas", "houston", "portland", "phoenix", "vegas", "orlando", "hawaii", "texas",
    "california", "florida", "york", "jfk", "lax", "heathrow",
    # languages and code
    "english", "french", "spanish", "german", "italian", "portuguese", "chinese", "japanese",
    "korean", "russian", "arabic", "hindi", "dutch", "python", "java", "javascript", "js",
    "typescript", "ts", "rust", "golang", "ruby", "php", "kotlin", "swift", "scala", "perl",
    "haskell", "c++", "c#", "cpp", "sql", "bash", "powershell", "html", "css", "json",
    "yaml", "xml", "csv", "toml", "react", "vue", "angular", "django", "flask", "fastapi",
    "numpy", "pandas", "pytorch", "tensorflow", "docker", "kubernetes", "k8s", "git", "github",
    "gitlab", "postgres", "postgresql", "mysql", "sqlite", "mongodb", "redis", "kafka", "nginx",
    "linux", "ubuntu", "debian", "windows", "macos", "mac", "ios", "android", "aws", "azure",
    "gcp", "s3", "ec2", "vscode", "vim", "emacs", "excel", "powerpoint", "gmail", "outlook",
    "slack", "chrome", "firefox", "safari", "npm", "pip", "conda", "nodejs",
    # brands and products
    "apple", "google", "amazon", "microsoft", "facebook", "instagram", "whatsapp",
    "tiktok", "twitter", "netflix", "spotify", "tesla", "nvidia", "intel", "amd", "samsung",
    "sony", "nintendo", "playstation", "xbox", "iphone", "ipad", "macbook",
    "kindle", "alexa", "uber", "lyft", "airbnb", "paypal", "venmo", "mastercard",
    "amex", "nike", "adidas", "ikea", "costco", "walmart", "ebay", "etsy", "toyota",
    "honda", "ford", "bmw", "audi",
    # medicines and conditions
    "ibuprofen", "acetaminophen", "paracetamol", "aspirin", "tylenol", "advil", "motrin",
    "naproxen", "aleve", "amoxicillin", "penicillin", "metformin", "insulin", "lisinopril",
    "atorvastatin", "omeprazole", "prednisone", "melatonin", "benadryl", "zyrtec", "claritin",
    "covid", "flu", "diabetes", "asthma", "migraine",
    # weekdays and months
    "monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday", "january",
    "february", "march", "april", "june", "july", "august", "september", "october",
    "november", "december", "christmas", "easter", "thanksgiving",
})  # fmt: skip

STOPWORDS = frozenset({
    "a", "an", "the", "i", "me", "my", "we", "our", "you", "your", "it", "its", "is", "are",
    "was", "were", "be", "been", "am", "do", "does", "did", "can", "could", "should", "would",
    "will", "shall", "may", "might", "must", "have", "has", "had", "what", "whats", "which",
    "who", "whom", "how", "why", "when", "where", "there", "this", "that", "these", "those",
    "of", "for", "on", "at", "with", "about", "and", "or", "but", "if", "so", "just", "please",
    "tell", "show", "give", "get", "find", "need", "want", "like", "know", "way", "any",
    "im", "ive", "id", "hey", "hi", "hello", "thanks", "pls", "plz", "u", "ur", "r", "some",
    "then", "also", "too", "very", "really", "much", "many", "here", "out", "up", "via", "as",
    "in", "into", "to", "from", "than", "by", "per", "over", "under", "after", "before",
})  # fmt: skip
