"""Writes prompts.jsonl: extraction prompts with strict schemas (arrays of objects, enums,
nullable integers), in the bench's JSONL form ({"id", "messages", "schema", "schema_name"}).
Run from this folder: python make_prompts.py"""

import json

ANSWER = "Answer with a JSON object only."


def string(n=60):
    return {"type": "string", "maxLength": n}


def nullable_int(lo=0, hi=100000):
    return {"type": ["integer", "null"], "minimum": lo, "maximum": hi}


def obj(**props):
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def array(items, lo=0, hi=None):
    out = {"type": "array", "items": items, "minItems": lo}
    return out if hi is None else {**out, "maxItems": hi}


PROMPTS = [
    ("booking", "Extract the booking: every passenger and every flight.",
     "Booking ref QX7P2M for the Lindqvist family. Passengers: Erik Lindqvist (adult, 41) and his daughter "
     "Mia (infant, 11 months old, travels on his lap). Outbound: SK1415 from Stockholm ARN to Nice NCE on "
     "14 June, departing 07:05, seat 12C. Return: SK1420 from Nice NCE to Stockholm ARN on 28 June, departing "
     "18:40, seat 14A. Fare class: economy. Total paid 6,480 SEK.",
     obj(reference=string(12), passengers=array(obj(name=string(), type={"enum": ["adult", "child", "infant"]},
                                                    age=nullable_int(0, 120)), 1),
         flights=array(obj(number=string(10), origin=string(3), destination=string(3), date=string(20),
                           departure=string(5), seat={"type": ["string", "null"], "maxLength": 4}), 1),
         fare_class={"enum": ["economy", "premium", "business", "first"]}, total_sek=nullable_int(0, 10**7))),
    ("invoice", "Extract the invoice with all of its line items.",
     "INVOICE #2024-0193 from Brightline Printing Ltd to Okoro & Daughters, due 30 days. Items: 500 business "
     "cards at 0.12 each; 2 roll-up banners at 85.00 each; 1 design fee (flat) 120.00. Shipping is free. "
     "VAT at 20% applies. Status: unpaid.",
     obj(number=string(20), seller=string(), buyer=string(), due_days=nullable_int(0, 365),
         items=array(obj(description=string(), quantity=nullable_int(0, 100000), unit_price={"type": "number",
                                                                                             "minimum": 0}), 1),
         vat_percent=nullable_int(0, 100), status={"enum": ["paid", "unpaid", "overdue"]})),
    ("recipe", "Extract the recipe: its ingredients and its steps.",
     "Lemon ricotta pancakes (serves 4, 25 minutes). You need 250 g ricotta, 3 eggs, 120 g flour, 1 lemon "
     "(zest only), 2 tbsp sugar and a pinch of salt. Whisk the ricotta, yolks, zest and sugar. Fold in the "
     "flour and salt. Beat the whites stiff and fold them in. Fry spoonfuls in butter, 2 minutes a side.",
     obj(title=string(), servings=nullable_int(1, 100), minutes=nullable_int(0, 1440),
         difficulty={"enum": ["easy", "medium", "hard"]},
         ingredients=array(obj(name=string(40), amount={"type": ["number", "null"]},
                               unit={"enum": ["g", "ml", "tbsp", "tsp", "piece", "pinch", "none"]}), 1),
         steps=array(string(160), 1))),
    ("org_chart", "Extract the team's org chart: each person, their role and whom they report to.",
     "The data platform team: Priya Raman is the head of data. Two leads report to her: Tomás Ortega (lead, "
     "ingestion) and Hannah Weiss (lead, analytics). Tomás manages engineers Li Wei and Sam Carter; Hannah "
     "manages analyst Amara Diallo, who joined as an intern last month.",
     obj(team=string(), people=array(obj(name=string(40), role={"enum": ["head", "lead", "engineer", "analyst",
                                                                             "intern"]},
                                         area={"type": ["string", "null"], "maxLength": 30},
                                         reports_to={"type": ["string", "null"], "maxLength": 40}), 1))),
    ("shipment", "Extract the shipment: its packages and their tracking events.",
     "Order 88-1172 ships in two parcels with DHL. Parcel A (2.4 kg) was picked up in Leipzig on 3 March and "
     "reached the Paris hub on 4 March. Parcel B (0.8 kg) was picked up in Leipzig on 3 March, is held at "
     "customs in Basel since 5 March.",
     obj(order=string(20), carrier={"enum": ["DHL", "UPS", "FedEx", "GLS", "other"]},
         packages=array(obj(label=string(10), weight_grams=nullable_int(0, 10**6),
                            events=array(obj(date=string(20), place=string(40),
                                             status={"enum": ["picked_up", "in_transit", "at_hub", "customs",
                                                              "delivered"]}), 1)), 1))),
    ("prescriptions", "Extract the prescriptions from the discharge note.",
     "Discharge note, patient J. Alvarez, 67. Continue metformin 500 mg twice daily. Start atorvastatin 20 mg "
     "once daily at night. Stop ibuprofen. Paracetamol 1 g up to four times daily as needed for pain, for 5 "
     "days. Follow-up with the GP in 2 weeks.",
     obj(patient=string(40), age=nullable_int(0, 130),
         medications=array(obj(drug=string(40), dose_mg=nullable_int(0, 10000),
                               times_per_day=nullable_int(0, 24),
                               action={"enum": ["continue", "start", "stop", "as_needed"]},
                               days={"type": ["integer", "null"], "minimum": 0, "maximum": 3650}), 1),
         follow_up_weeks=nullable_int(0, 52))),
    ("festival", "Extract the festival line-up: each stage and its acts.",
     "Saturday at Riverside Fest. Main stage: The Vellums at 18:00 (60 min), Nadia Kho at 19:30 (75 min), "
     "headliner Glass Harbour at 21:30 (90 min). Tent stage: DJ Orrin at 20:00 (120 min) and a secret guest "
     "at 22:30, length not announced. Tickets: day pass 55 EUR.",
     obj(festival=string(40), day={"enum": ["friday", "saturday", "sunday"]},
         stages=array(obj(name=string(30), acts=array(obj(artist=string(40), start=string(5),
                                                          minutes=nullable_int(0, 600),
                                                          billing={"enum": ["headliner", "regular", "secret"]}),
                                                      1)), 1),
         day_pass_eur=nullable_int(0, 10000))),
    ("listings", "Extract every apartment listed, with its rooms.",
     "Two flats for rent in Porto. Flat 1, Rua das Flores: 2 bedrooms (12 m2 and 9 m2), a 20 m2 living room, "
     "4th floor with a lift, 1,150 EUR a month. Flat 2, Boavista: a studio, one 28 m2 room, ground floor, no "
     "lift, 690 EUR a month, available now.",
     obj(city=string(30), flats=array(obj(street=string(40), floor=nullable_int(-5, 200), lift={"type": "boolean"},
                                          rent_eur=nullable_int(0, 100000),
                                          rooms=array(obj(kind={"enum": ["bedroom", "living", "studio", "kitchen",
                                                                         "bath"]},
                                                          area_m2=nullable_int(0, 1000)), 1)), 1))),
    ("match", "Extract the match report: both teams, their goals and their cards.",
     "Final: Ajaccio 2, Brest 1. Goals: Ajaccio's Moreau (23rd minute) and Diallo (penalty, 78th); Brest's "
     "Le Guen (55th). Cards: yellow for Brest's Kerbrat (40th), red for Ajaccio's Santos (88th). Attendance "
     "9,412.",
     obj(teams=array(obj(name=string(30), score=nullable_int(0, 50),
                         goals=array(obj(player=string(30), minute=nullable_int(0, 130),
                                         kind={"enum": ["open_play", "penalty", "own_goal"]})),
                         cards=array(obj(player=string(30), minute=nullable_int(0, 130),
                                         color={"enum": ["yellow", "red"]}))), 2, 2),
         attendance=nullable_int(0, 200000))),
    ("courses", "Extract the timetable: each course and its sessions.",
     "Spring term timetable. Linear Algebra (MATH201, 5 credits): lectures Monday and Wednesday 9:00 in room "
     "B12, tutorial Friday 14:00 in room C3. Databases (CS240, 4 credits): lecture Tuesday 11:00 in room A1, lab "
     "Thursday 15:00, room to be announced.",
     obj(term={"enum": ["autumn", "spring", "summer"]},
         courses=array(obj(code=string(10), title=string(40), credits=nullable_int(0, 30),
                           sessions=array(obj(kind={"enum": ["lecture", "tutorial", "lab"]},
                                              day={"enum": ["monday", "tuesday", "wednesday", "thursday", "friday"]},
                                              time=string(5),
                                              room={"type": ["string", "null"], "maxLength": 10}), 1)), 1))),
]

with open("prompts.jsonl", "w", encoding="utf-8") as f:
    for pid, request, text, schema in PROMPTS:
        message = f"{request}\n\nText:\n{text}\n\n{ANSWER}"
        f.write(json.dumps({"id": f"json-whitespace/{pid}", "messages": [{"role": "user", "content": message}],
                            "schema": schema, "schema_name": pid}, ensure_ascii=False) + "\n")
print(f"wrote {len(PROMPTS)} prompts to prompts.jsonl")
