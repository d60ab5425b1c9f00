/**
 * A query corpus shared by the parity tests: each entry runs through edgepg and through pg over
 * TCP against the same database, and the outcomes (result or error) must be deep-equal.
 *
 * Everything is data: `buildCorpus(schema)` gives the entries, `setupSql(schema)` and
 * `teardownSql(schema)` the schema they need. Entries leave the database as they found it (or are
 * idempotent), so the corpus can run any number of times, through any number of drivers, in any
 * order. None of them depend on session state, the session's backend or the clock.
 */
import pg from 'pg'

export interface CorpusEntry {
  /** Unique, human-readable; used in assertion messages. */
  name: string
  text: string
  values?: unknown[]
  rowMode?: 'array'
  /** Per-query type parsers (pg's `types` query option). */
  types?: { getTypeParser: (oid: number, format?: any) => (value: any) => any }
  /** The SQLSTATE the query must fail with; entries without it must succeed. */
  error?: string
}

/** A schema name no other test run against the same database will pick. */
export function uniqueSchema(prefix = 'edgepg_parity'): string {
  return `${prefix}_${process.pid}_${Date.now().toString(36)}`
}

export function setupSql(s: string): string {
  return `
    CREATE SCHEMA ${s};
    CREATE TYPE ${s}.mood AS ENUM ('sad', 'ok', 'happy');
    CREATE TABLE ${s}.items (
      id int PRIMARY KEY,
      name text NOT NULL UNIQUE,
      qty int NOT NULL CHECK (qty >= 0),
      mood ${s}.mood,
      meta jsonb,
      price numeric(10, 2)
    );
    CREATE TABLE ${s}.orders (
      id int PRIMARY KEY,
      item_id int NOT NULL REFERENCES ${s}.items (id),
      note varchar(20)
    );
    CREATE TABLE ${s}.kv (k text PRIMARY KEY, v text);
    CREATE TABLE ${s}.blobs (id int PRIMARY KEY, data bytea NOT NULL);
    INSERT INTO ${s}.items VALUES
      (1, 'widget', 5, 'happy', '{"color": "red", "tags": ["a", "b"]}', 9.99),
      (2, 'gadget', 0, 'sad', NULL, 120.50),
      (3, 'gizmo ✓', 12, NULL, '{"nested": {"deep": [1, null, true]}}', NULL);
    INSERT INTO ${s}.orders VALUES (10, 1, 'first'), (11, 1, NULL), (12, 3, 'ünïcödé');
    INSERT INTO ${s}.kv VALUES ('a', 'alpha'), ('b', NULL);
  `
}

export function teardownSql(s: string): string {
  return `DROP SCHEMA IF EXISTS ${s} CASCADE`
}

const INT8 = 20
const NUMERIC = 1700
const DATE = 1082
const TIMESTAMPTZ = 1184
const JSONB = 3802

/** Every column comes back as the raw text Postgres sent. */
const rawText = { getTypeParser: () => (value: string) => value }

/** int8 as BigInt, numeric as Number, date as its text, jsonb with an extra wrapper; the rest as pg does. */
const custom = {
  getTypeParser(oid: number, format?: any) {
    if (oid === INT8) return (v: string) => BigInt(v)
    if (oid === NUMERIC) return (v: string) => Number(v)
    if (oid === DATE) return (v: string) => `date:${v}`
    if (oid === JSONB) return (v: string) => ({ parsed: JSON.parse(v) })
    return pg.types.getTypeParser(oid, format)
  },
}

/** A value with `toPostgres`, which pg serialises through that method. */
class Point2 {
  constructor(readonly x: number, readonly y: number) {}
  toPostgres() {
    return `(${this.x},${this.y})`
  }
}

const when = new Date(Date.UTC(2024, 0, 2, 3, 4, 5, 678))

export function buildCorpus(s: string): CorpusEntry[] {
  return [
    // ── integers ────────────────────────────────────────────────────────────────────────────
    { name: 'int2/int4/int8 limits', text: `SELECT 1::int2 AS a, (-32768)::int2 AS b, 32767::int2 AS c, 2147483647::int4 AS d, (-2147483648)::int4 AS e, 9223372036854775807::int8 AS f, (-9223372036854775808)::int8 AS g` },
    { name: 'integer parameters', text: 'SELECT $1::int2 AS a, $2::int4 AS b, $3::int8 AS c, $4::int8 AS d', values: [-7, 2147483647, '9007199254740993', 42] },
    { name: 'integer arithmetic and aggregates', text: 'SELECT sum(i) AS s, count(*) AS n, avg(i) AS a, max(i)::int2 AS m FROM generate_series(1, 1000) i' },
    // ── numeric / float ─────────────────────────────────────────────────────────────────────
    { name: 'numeric precision, NaN, infinity, typmod', text: `SELECT 1.5::numeric AS a, '123456789012345678901234567890.123456789'::numeric AS b, 'NaN'::numeric AS c, 'Infinity'::numeric AS d, (-0.000001)::numeric(10, 6) AS e, 0::numeric(5, 2) AS f` },
    { name: 'numeric parameters', text: 'SELECT $1::numeric AS a, $2::numeric AS b, $3::numeric(8, 3) AS c', values: ['3.14159265358979323846264338327950288', 1e21, 2.5] },
    { name: 'float4/float8 special values', text: `SELECT 1.5::float4 AS a, 0.1::float4 AS b, 0.1::float8 AS c, 'NaN'::float8 AS d, 'Infinity'::float8 AS e, '-Infinity'::float4 AS f, 1e308::float8 AS g, '-0'::float8 AS h, 1e-310::float8 AS i` },
    { name: 'float parameters', text: 'SELECT $1::float8 AS a, $2::float4 AS b, $3::float8 AS c, $4::float8 AS d', values: [0.1 + 0.2, 3.4e38, NaN, -Infinity] },
    // ── bool ────────────────────────────────────────────────────────────────────────────────
    { name: 'booleans', text: 'SELECT true AS t, false AS f, NULL::bool AS n, 1 < 2 AS cmp' },
    { name: 'boolean parameters', text: 'SELECT $1::bool AS a, $2::bool AS b, $3::bool AS c', values: [true, false, 'yes'] },
    // ── text ────────────────────────────────────────────────────────────────────────────────
    { name: 'text, varchar, char, "char", name', text: `SELECT 'abc'::text AS t, 'xyz'::varchar(10) AS v, 'ab'::char(5) AS c, ''::text AS empty, 'q'::"char" AS qc, 'pg_class'::name AS nm, 'x'::varchar AS vu` },
    { name: 'text parameter with quotes, backslashes, newlines, tabs', text: 'SELECT $1::text AS t, length($1::text) AS n', values: ['it\'s "quoted" \\ back\\slash\nnew line\ttab \r\n'] },
    { name: 'large text value', text: `SELECT repeat('xyz', 100000) AS big, repeat('é', 5000) AS accents` },
    // ── bytea ───────────────────────────────────────────────────────────────────────────────
    { name: 'bytea literals', text: `SELECT '\\xdeadbeef'::bytea AS a, ''::bytea AS b, NULL::bytea AS c, 'abc\\000def'::bytea AS d, decode(repeat('ff00', 1000), 'hex') AS e` },
    { name: 'bytea parameter (Buffer)', text: 'SELECT $1::bytea AS b, length($1::bytea) AS n, md5($1::bytea) AS h', values: [Buffer.from([0, 1, 2, 127, 128, 254, 255, 0, 92, 39, 34])] },
    { name: 'bytea parameter (Uint8Array)', text: 'SELECT $1::bytea AS b', values: [new Uint8Array([9, 8, 7, 0, 255])] },
    // ── json / jsonb ────────────────────────────────────────────────────────────────────────
    { name: 'json values', text: `SELECT '{"a":1,"b":[1,2,null],"c":"x"}'::json AS o, '[1,"two",3.5]'::json AS a, 'null'::json AS n, '"s"'::json AS s, '42'::json AS num, '{"dup":1,"dup":2}'::json AS dup` },
    { name: 'jsonb values', text: `SELECT '{"b":2,"a":{"z":[true,false,null],"y":"ü"}}'::jsonb AS o, '[]'::jsonb AS e, '1e3'::jsonb AS num, jsonb_build_object('k', 1, 'l', ARRAY[1,2]) AS built` },
    { name: 'json operators', text: `SELECT meta->'tags' AS tags, meta->>'color' AS color, meta #> '{nested,deep}' AS deep, jsonb_typeof(meta) AS t FROM ${s}.items ORDER BY id` },
    { name: 'object parameter (JSON.stringify)', text: 'SELECT $1::jsonb AS b, $1::json AS j, $2::jsonb AS nested', values: [{ a: 1, s: 'ü ✓', n: null, list: [1, 'two', null] }, { deep: { deeper: { deepest: [[], {}] } } }] },
    // ── uuid ────────────────────────────────────────────────────────────────────────────────
    { name: 'uuid literal and parameter', text: `SELECT 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'::uuid AS a, $1::uuid AS b, '{A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A12}'::uuid AS c`, values: ['00000000-0000-0000-0000-000000000000'] },
    // ── dates and times ─────────────────────────────────────────────────────────────────────
    { name: 'date', text: `SELECT '2024-02-29'::date AS leap, '1970-01-01'::date AS epoch, 'infinity'::date AS inf, '-infinity'::date AS ninf, '0044-03-15 BC'::date AS bc, '9999-12-31'::date AS far` },
    { name: 'time and timetz', text: `SELECT '13:45:30.123456'::time AS t, '00:00'::time AS midnight, '24:00'::time AS end_of_day, '23:59:59+02'::timetz AS tz, '10:00:00.5-03:30'::timetz AS tz2` },
    { name: 'timestamp', text: `SELECT '2024-01-02 03:04:05.678'::timestamp AS a, '2024-01-02 03:04:05.678912'::timestamp AS micros, 'infinity'::timestamp AS inf, '-infinity'::timestamp AS ninf, '1900-06-30 12:00'::timestamp AS old, '0010-01-01 00:00 BC'::timestamp AS bc` },
    { name: 'timestamptz', text: `SELECT '2024-01-02 03:04:05.678+05:30'::timestamptz AS a, '1999-12-31 23:59:59.999999Z'::timestamptz AS b, 'infinity'::timestamptz AS inf, '2024-03-31 02:30:00 Europe/Berlin'::timestamptz AS dst, '1901-01-01 00:00:00+00'::timestamptz AS old` },
    { name: 'Date parameters', text: 'SELECT $1::timestamptz AS tz, $1::timestamp AS ts, $1::date AS d, $2::timestamptz AS epoch, $3::timestamptz[] AS arr', values: [when, new Date(0), [when, null, new Date(Date.UTC(1999, 11, 31, 23, 59, 59, 999))]] },
    { name: 'interval', text: `SELECT '1 year 2 months 3 days 04:05:06.789'::interval AS a, '-1 day'::interval AS b, '0'::interval AS c, '-1 year -2 mons +3 days -04:05:06'::interval AS d, '1.5 seconds'::interval AS e, '100 hours'::interval AS f` },
    { name: 'interval parameter and arithmetic', text: `SELECT $1::interval AS i, '2024-01-31'::date + '1 month'::interval AS t, age('2024-03-01'::timestamp, '2023-01-15'::timestamp) AS age`, values: ['P1Y2M3DT4H5M6S'] },
    // ── arrays ──────────────────────────────────────────────────────────────────────────────
    { name: 'int arrays with NULLs, nested, empty', text: `SELECT ARRAY[1, 2, NULL, 4]::int[] AS a, '{{1,2},{3,NULL}}'::int[] AS nested, '{}'::int[] AS empty, '{{{1,2},{3,4}},{{5,6},{NULL,8}}}'::int[] AS three, ARRAY[NULL]::int8[] AS only_null, ARRAY[1, 2]::int2[] AS small` },
    { name: 'text arrays with quoting and NULLs', text: `SELECT ARRAY['a', NULL, 'b,c', 'd"e', 'NULL', '', 'back\\slash', '{brace}', ' sp ']::text[] AS t, ARRAY['x', 'y']::varchar[] AS v, '{{a,NULL},{"c d",e}}'::text[] AS nested` },
    { name: 'arrays of other types', text: `SELECT ARRAY[true, NULL, false] AS b, ARRAY[1.5, NULL, 'NaN']::float8[] AS f, ARRAY[1.25, NULL]::numeric[] AS n, ARRAY['2024-01-01', NULL]::date[] AS d, ARRAY['2024-01-01 10:00+00']::timestamptz[] AS tz, ARRAY['{"a":1}', NULL]::json[] AS j, ARRAY['[1]']::jsonb[] AS jb, ARRAY['a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11']::uuid[] AS u, ARRAY['\\x00ff'::bytea, NULL] AS by, ARRAY['1 day']::interval[] AS iv` },
    { name: 'array parameters (flat, nested, NULLs)', text: 'SELECT $1::int[] AS a, $2::text[] AS b, $3::float8[] AS c, $4::bool[] AS d, $5::int[] AS empty', values: [[1, 2, null, 3], [['a', 'b'], ['c', null]], [0.5, -1e10], [true, false, null], []] },
    { name: 'array parameter with quotes and Buffers', text: 'SELECT $1::text[] AS t, $2::bytea[] AS b, $3::jsonb[] AS j', values: [['say "hi"', 'back\\slash', 'comma,here', '{}'], [Buffer.from('hi'), null, Buffer.from([0, 255])], [{ a: 1 }, { b: [2] }]] },
    { name: 'array functions', text: `SELECT array_length(ARRAY[1,2,3], 1) AS len, array_agg(i ORDER BY i DESC) AS agg, unnest(ARRAY[[1,2],[3,4]]) AS un FROM generate_series(1, 3) i GROUP BY 3 ORDER BY 3` },
    // ── enums ───────────────────────────────────────────────────────────────────────────────
    { name: 'enum values and enum arrays', text: `SELECT 'happy'::${s}.mood AS m, enum_range(NULL::${s}.mood) AS r, ARRAY['sad', NULL]::${s}.mood[] AS arr, 'ok'::${s}.mood < 'happy'::${s}.mood AS ordered` },
    { name: 'enum parameter and table column', text: `SELECT id, mood FROM ${s}.items WHERE mood = $1::${s}.mood OR mood IS NULL ORDER BY id`, values: ['happy'] },
    // ── NULLs ───────────────────────────────────────────────────────────────────────────────
    { name: 'NULL of many types', text: 'SELECT NULL AS untyped, NULL::int AS i, NULL::text AS t, NULL::jsonb AS j, NULL::int[] AS a, NULL::timestamptz AS ts, NULL::uuid AS u, NULL::interval AS iv' },
    { name: 'null and undefined parameters', text: 'SELECT $1::text AS a, $2::int AS b, $3::jsonb AS c, $1::text IS NULL AS a_null, $2::int IS NULL AS b_null', values: [null, undefined, null] },
    // ── rowMode 'array' ─────────────────────────────────────────────────────────────────────
    { name: "rowMode 'array' with duplicate column names", text: 'SELECT 1 AS x, 2 AS x, NULL AS x, $1::text AS y', values: ['why'], rowMode: 'array' },
    { name: "rowMode 'array' over a table", text: `SELECT * FROM ${s}.items ORDER BY id`, rowMode: 'array' },
    { name: "rowMode 'array' simple query with no rows", text: 'SELECT 1 AS a, 2 AS b WHERE false', rowMode: 'array' },
    { name: 'duplicate column names in object mode (last wins)', text: `SELECT 1 AS x, 'two' AS x, 3 AS "X"` },
    // ── custom type parsers (per query) ─────────────────────────────────────────────────────
    { name: 'per-query types: everything raw text', text: `SELECT 1::int8 AS i, 1.50::numeric AS n, '2024-01-02'::date AS d, '{"a":1}'::jsonb AS j, true AS b, ARRAY[1,2] AS a, '\\x0102'::bytea AS by`, types: rawText },
    { name: 'per-query types: BigInt, Number, date text, wrapped jsonb', text: `SELECT 9223372036854775807::int8 AS big, $1::numeric AS n, '2024-02-29'::date AS d, '{"x":[1]}'::jsonb AS j, 2024::int4 AS untouched`, values: ['12.5'], types: custom },
    { name: "per-query types with rowMode 'array'", text: 'SELECT count(*) AS c, 1.25::numeric AS n, now() - now() AS zero', rowMode: 'array', types: custom },
    // ── multi-statement simple queries ──────────────────────────────────────────────────────
    { name: 'multi-statement: three SELECTs', text: `SELECT 1 AS a; SELECT 'x' AS b, 2.5::float8 AS c; VALUES (1, 'one'), (2, 'two')` },
    { name: 'multi-statement: transaction with DML rolled back', text: `BEGIN; UPDATE ${s}.items SET qty = qty + 1 WHERE id IN (1, 2); SELECT id, qty FROM ${s}.items ORDER BY id; DELETE FROM ${s}.orders WHERE id = 10; ROLLBACK` },
    { name: 'multi-statement: DDL in a rolled-back transaction', text: `BEGIN; CREATE TABLE ${s}.scratch (a int); INSERT INTO ${s}.scratch VALUES (1), (2), (3); SELECT sum(a)::int AS total FROM ${s}.scratch; SET LOCAL work_mem = '8MB'; SHOW work_mem; ROLLBACK` },
    { name: 'multi-statement: empty statements between', text: 'SELECT 1 AS a;;; SELECT 2 AS b;' },
    { name: "multi-statement with rowMode 'array'", text: 'SELECT 1 AS a, 2 AS b; SELECT 3 AS c', rowMode: 'array' },
    { name: 'multi-statement: error in the middle', text: 'SELECT 1 AS a; SELECT 1/0 AS boom; SELECT 3 AS c', error: '22012' },
    // ── empty query ─────────────────────────────────────────────────────────────────────────
    { name: 'empty query', text: '' },
    { name: 'whitespace-only query', text: '   \n\t ' },
    { name: 'comment-only query', text: '-- nothing here\n/* nor here */' },
    { name: 'lone semicolon', text: ';' },
    // ── parameters of every JS kind ─────────────────────────────────────────────────────────
    {
      name: 'parameters of every JS kind together',
      text: 'SELECT $1::timestamptz AS date, $2::bytea AS buffer, $3::int[] AS array, $4::jsonb AS object, $5::int8 AS bigint, $6::text AS null, $7::text AS undef, $8::text AS string, $9::float8 AS number, $10::bool AS boolean, $11::text AS nested_array',
      values: [when, Buffer.from('buf ✓'), [1, 2, 3], { k: 'v', n: [1] }, 12345678901234567n, null, undefined, 'str', 1.25, true, [['a', null], ['b', 'c']]],
    },
    { name: 'bigint parameters', text: 'SELECT $1::int8 AS max, $2::int8 AS min, $3::numeric AS huge, $4::int8 + 1 AS plus', values: [9223372036854775807n, -9223372036854775808n, 123456789012345678901234567890n, 0n] },
    { name: 'untyped parameters are text', text: 'SELECT $1 AS num, $2 AS bool, $3 AS str, $4 AS date, $5 AS obj', values: [42, false, 'plain', when, { a: [1] }] },
    { name: 'toPostgres parameter', text: 'SELECT $1::point AS p, $2::text AS t', values: [new Point2(1.5, -2), new Point2(0, 0)] },
    { name: 'numbers and strings coerced by the server', text: 'SELECT $1::int + $2::int AS sum, $3::text || $4::text AS cat', values: ['40', 2, 10, 'x'] },
    // ── other types ─────────────────────────────────────────────────────────────────────────
    { name: 'geometric, network, money, oid, ranges, tsvector', text: `SELECT '(1,2)'::point AS p, '<(1,2),3>'::circle AS c, '192.168.0.1/24'::inet AS ip, '10.0.0.0/8'::cidr AS net, '08:00:2b:01:02:03'::macaddr AS mac, 12.34::money AS m, 'pg_class'::regclass::oid AS o, int4range(1, 10) AS r, tstzrange('2024-01-01 00:00+00', NULL) AS tr, to_tsvector('simple', 'the quick fox') AS ts, B'1010' AS bits, '<a>x</a>'::xml AS x` },
    // ── unicode ─────────────────────────────────────────────────────────────────────────────
    { name: 'unicode literals and lengths', text: `SELECT 'héllo wörld ✓ 日本語 🐘 ' || chr(128512) AS s, length('日本語 🐘') AS chars, octet_length('日本語 🐘') AS bytes, upper('straße') AS up` },
    { name: 'unicode parameters and column names', text: 'SELECT $1::text AS "ключ 🔑", $2::text AS "列", $1::text = $2::text AS same', values: ['Ωmega 🐘 ζ', 'combining e\u0301 vs \u00e9 and 𝔘𝔫𝔦'] },
    { name: 'unicode in a table', text: `SELECT items.id, name, note FROM ${s}.items JOIN ${s}.orders ON orders.item_id = items.id WHERE note ~ '[^ -~]' OR name ~ '[^ -~]' ORDER BY items.id, note` },
    // ── table reads and writes ──────────────────────────────────────────────────────────────
    { name: 'SELECT * over a table (tableID/columnID)', text: `SELECT * FROM ${s}.items ORDER BY id` },
    { name: 'join with parameters', text: `SELECT o.id, i.name, o.note, i.price * $1 AS total FROM ${s}.orders o JOIN ${s}.items i ON i.id = o.item_id WHERE o.id >= $2 ORDER BY o.id`, values: [3, 11] },
    { name: 'empty result with fields', text: `SELECT * FROM ${s}.items WHERE id < 0` },
    { name: 'idempotent upsert RETURNING', text: `INSERT INTO ${s}.kv (k, v) VALUES ($1, $2) ON CONFLICT (k) DO UPDATE SET v = EXCLUDED.v RETURNING k, v`, values: ['upsert-returning', 'value ✓'] },
    { name: 'idempotent upsert without RETURNING', text: `INSERT INTO ${s}.kv (k, v) VALUES ('upsert-plain', 'v'), ('upsert-plain-2', NULL) ON CONFLICT (k) DO UPDATE SET v = EXCLUDED.v` },
    { name: 'no-op UPDATE rowCount', text: `UPDATE ${s}.items SET qty = qty WHERE qty > $1`, values: [0] },
    { name: 'UPDATE RETURNING in a CTE', text: `WITH u AS (UPDATE ${s}.items SET name = name WHERE id <= 2 RETURNING id) SELECT count(*)::int AS updated, array_agg(id ORDER BY id) AS ids FROM u` },
    { name: 'DELETE matching nothing', text: `DELETE FROM ${s}.kv WHERE k = $1`, values: ['absent'] },
    { name: 'SELECT ... FOR UPDATE', text: `SELECT k, v FROM ${s}.kv WHERE k IN ('a', 'b') ORDER BY k FOR UPDATE` },
    { name: 'DO block without output', text: `DO $$ BEGIN PERFORM 1; END $$` },
    { name: 'transaction-local set_config', text: `SELECT set_config('edgepg.parity', 'x', true) AS set, current_setting('edgepg.parity', true) AS got` },
    // ── errors ──────────────────────────────────────────────────────────────────────────────
    { name: 'error: syntax', text: 'SELEC 1', error: '42601' },
    { name: 'error: syntax with parameters (extended protocol)', text: 'SELECT $1::int FROM WHERE', values: [1], error: '42601' },
    { name: 'error: unterminated string', text: "SELECT 'abc", error: '42601' },
    { name: 'error: undefined table', text: `SELECT * FROM ${s}.nope`, error: '42P01' },
    { name: 'error: undefined column', text: `SELECT nope FROM ${s}.items`, error: '42703' },
    { name: 'error: undefined function (hint)', text: `SELECT ${s}.nofn($1::int)`, values: [1], error: '42883' },
    { name: 'error: division by zero', text: 'SELECT 1/0', error: '22012' },
    { name: 'error: division by zero with parameters', text: 'SELECT $1::int / $2::int AS q', values: [1, 0], error: '22012' },
    { name: 'error: numeric division by zero', text: 'SELECT 1.0 / 0.0', error: '22012' },
    { name: 'error: unique violation (primary key)', text: `INSERT INTO ${s}.items (id, name, qty) VALUES (1, 'dup', 1)`, error: '23505' },
    { name: 'error: unique violation (unique column) with parameters', text: `INSERT INTO ${s}.items (id, name, qty) VALUES ($1, $2, $3)`, values: [999, 'widget', 1], error: '23505' },
    { name: 'error: not-null violation', text: `INSERT INTO ${s}.items (id, name, qty) VALUES (998, NULL, 1)`, error: '23502' },
    { name: 'error: check violation', text: `UPDATE ${s}.items SET qty = -1 WHERE id = 1`, error: '23514' },
    { name: 'error: foreign key violation on insert', text: `INSERT INTO ${s}.orders (id, item_id) VALUES (900, 12345)`, error: '23503' },
    { name: 'error: foreign key violation on delete', text: `DELETE FROM ${s}.items WHERE id = 1`, error: '23503' },
    { name: 'error: invalid input syntax', text: "SELECT 'abc'::int", error: '22P02' },
    { name: 'error: invalid parameter value', text: 'SELECT $1::int AS n', values: ['abc'], error: '22P02' },
    { name: 'error: value out of range', text: 'SELECT 32768::int2', error: '22003' },
    { name: 'error: invalid enum value', text: `SELECT 'angry'::${s}.mood`, error: '22P02' },
    { name: 'error: JS array sent to a jsonb parameter', text: 'SELECT $1::jsonb AS j', values: [[1, 2]], error: '22P02' },
    { name: 'error: subquery returns more than one row', text: 'SELECT (SELECT generate_series(1, 2))', error: '21000' },
    { name: 'error: wrong number of bind parameters', text: 'SELECT $1::int, $2::int', values: [1], error: '08P01' },
    { name: 'error: inside PL/pgSQL (where)', text: 'DO $$ BEGIN PERFORM 1/0; END $$', error: '22012' },
    { name: 'error: dynamic SQL (internalQuery, internalPosition)', text: `DO $$ BEGIN EXECUTE 'SELECT 1 FROM nowhere_' || 'x'; END $$`, error: '42P01' },
    {
      name: 'error: RAISE with every field set',
      text: `DO $$ BEGIN RAISE EXCEPTION 'custom % ✗', 42 USING DETAIL = 'the detail', HINT = 'the hint', ERRCODE = 'P0042', COLUMN = 'col', CONSTRAINT = 'con', DATATYPE = 'typ', TABLE = 'tab', SCHEMA = 'sch'; END $$`,
      error: 'P0042',
    },
    { name: 'error: unicode in the message', text: "SELECT 'ü日本🐘'::int", error: '22P02' },
    { name: "error: with rowMode 'array'", text: `SELECT id / (id - 1) FROM ${s}.items ORDER BY id`, rowMode: 'array', error: '22012' },
    { name: 'error: after some rows were sent', text: 'SELECT 10 / (3 - i) AS q FROM generate_series(1, 5) i', error: '22012' },
  ]
}
