/**
 * The code-running forms (issue 46), for test/code-forms.test.ts: every node of PostgreSQL 18's
 * grammar through which the database's own code runs for a plain-looking statement, each with the
 * objects it needs in an attacker's schema. Every hook calls leave(), which logs the backend it ran
 * on and the statement that ran it, then leaves its login role's EFFECT on the session.
 *
 * Not expressible, so not here: see NOT_EXPRESSIBLE.
 */
import { cstrings, int32, message } from './protocol'

/** What the attacker's code leaves on its backend; one login role each (leave() tells them apart by session_user). */
export const EFFECTS = [
  { key: 'path', name: 'search_path', body: (s: string) => `PERFORM set_config('search_path', '${s}, public', false);` },
  {
    key: 'state',
    name: 'temp table + advisory lock + LISTEN',
    body: () => `IF to_regclass('pg_temp.code_forms_left') IS NULL THEN CREATE TEMP TABLE code_forms_left (x int); END IF;
      PERFORM pg_advisory_lock(pg_backend_pid()); LISTEN code_forms;`,
  },
] as const
export type Effect = (typeof EFFECTS)[number]
export type EffectKey = Effect['key']

/** The custom types a form's values may be of (test/code-forms.test.ts looks up their OIDs). */
export const TYPES = ['rng', 'dom', 'blob'] as const
export type TypeKey = (typeof TYPES)[number]

/**
 * How a statement reaches Postgres: a Client's simple query; a Client's extended query (Parse with
 * no parameter types, the form's values bound); raw Parse/Bind/Execute/Sync whose Parse names the
 * parameters' types (forms of a custom type); POST /sql (extended, Neon's protocol).
 */
export type Way = 'simple' | 'extended' | 'raw' | 'http'

export interface Form {
  name: string
  /** The raw parse tree's node that runs the code (what a reader of the SQL would have to flag). */
  node: string
  /** The statement; `v(i)` writes its i-th value, as the way sends it (see `values`). */
  sql: (s: string, v: (i: number) => string) => string
  /**
   * Values the statement takes. Without `type`: literals in a simple query, $n elsewhere. With
   * `type` (in the attacker's schema): `type 'literal'` in a simple query, `$n::type` by extended
   * and /sql, bare `$n` typed by Parse's parameter OIDs by raw.
   */
  values?: Array<string | number>
  type?: TypeKey
  /** The ways it is sent (default: simple, extended, http, and raw for a form of a custom type). */
  ways?: Way[]
  /** raw: results asked for in binary (Bind's result format codes), which runs the type's send function. */
  binary?: true
  /** Objects of its own, made after the shared ones. */
  setup?: (s: string) => string[]
}

// Values of the range type `rng` with an infinite upper bound: reading one compares no bounds (range_in
// runs no code of ours), so it is the node that compares two of them that runs the opclass's function.
const R = ['[1,)', '[2,)', '[3,)']

export const FORMS: Form[] = [
  // Function calls.
  { name: 'call, unqualified (found in the "$user" schema)', node: 'FuncCall', sql: () => 'SELECT code_forms_call()' },
  { name: 'call, qualified', node: 'FuncCall', values: [1], sql: (s, v) => `SELECT ${s}.f(${v(0)})` },
  { name: 'set-returning function in FROM', node: 'RangeFunction', sql: (s) => `SELECT * FROM ${s}.srf(1)` },
  { name: 'LATERAL call', node: 'RangeFunction (lateral)', sql: (s) => `SELECT * FROM (VALUES (1)) v(x), LATERAL ${s}.srf(v.x)` },
  { name: 'ROWS FROM', node: 'RangeFunction (ROWS FROM)', sql: (s) => `SELECT * FROM ROWS FROM (${s}.srf(1), generate_series(1, 1))` },
  { name: 'aggregate (PL/pgSQL state function)', node: 'FuncCall (agg)', sql: (s) => `SELECT ${s}.agg(x) FROM (VALUES (1), (2)) v(x)` },
  { name: 'aggregate as a window function', node: 'FuncCall (over)', sql: (s) => `SELECT ${s}.agg(x) OVER () FROM (VALUES (1)) v(x)` },
  { name: 'window function (PL/pgSQL, WINDOW)', node: 'FuncCall (over)', sql: (s) => `SELECT ${s}.win() OVER ()` },
  // Operators.
  { name: 'binary operator', node: 'A_Expr (OP)', values: [1], sql: (s, v) => `SELECT 1 OPERATOR(${s}.##) ${v(0)}` },
  { name: 'prefix operator', node: 'A_Expr (OP, prefix)', values: [1], sql: (s, v) => `SELECT OPERATOR(${s}.!!) ${v(0)}` },
  { name: 'operator ANY (array)', node: 'A_Expr (OP_ANY)', values: [2], sql: (s, v) => `SELECT 1 OPERATOR(${s}.##) ANY (ARRAY[1, ${v(0)}])` },
  { name: 'operator ALL (array)', node: 'A_Expr (OP_ALL)', values: [1], sql: (s, v) => `SELECT 1 OPERATOR(${s}.##) ALL (ARRAY[1, ${v(0)}])` },
  { name: 'operator ANY (subquery)', node: 'SubLink (ANY)', sql: (s) => `SELECT 1 OPERATOR(${s}.##) ANY (SELECT 1)` },
  { name: 'operator ALL (subquery)', node: 'SubLink (ALL)', sql: (s) => `SELECT 1 OPERATOR(${s}.##) ALL (SELECT 1)` },
  { name: 'ORDER BY … USING OPERATOR() (a btree opclass of ours)', node: 'SortBy (useOp)', sql: (s) => `SELECT x FROM (VALUES (2), (1)) v(x) ORDER BY x USING OPERATOR(${s}.#<)` },
  // Comparisons of a type whose btree comparison is ours (a range over a subtype opclass of ours).
  { name: 'comparison operator', node: 'A_Expr (OP)', type: 'rng', values: R.slice(0, 2), sql: (_, v) => `SELECT ${v(0)} < ${v(1)}` },
  { name: 'IN list', node: 'A_Expr (IN)', type: 'rng', values: R, sql: (_, v) => `SELECT ${v(0)} IN (${v(1)}, ${v(2)})` },
  { name: '= ANY (ARRAY[…])', node: 'A_Expr (OP_ANY)', type: 'rng', values: R, sql: (_, v) => `SELECT ${v(0)} = ANY (ARRAY[${v(1)}, ${v(2)}])` },
  { name: 'BETWEEN', node: 'A_Expr (BETWEEN)', type: 'rng', values: R, sql: (_, v) => `SELECT ${v(1)} BETWEEN ${v(0)} AND ${v(2)}` },
  { name: 'IS DISTINCT FROM', node: 'A_Expr (DISTINCT)', type: 'rng', values: R.slice(0, 2), sql: (_, v) => `SELECT ${v(0)} IS DISTINCT FROM ${v(1)}` },
  { name: 'NULLIF', node: 'A_Expr (NULLIF)', type: 'rng', values: R.slice(0, 2), sql: (_, v) => `SELECT NULLIF(${v(0)}, ${v(1)})` },
  { name: 'GREATEST', node: 'MinMaxExpr', type: 'rng', values: R.slice(0, 2), sql: (_, v) => `SELECT GREATEST(${v(0)}, ${v(1)})` },
  { name: 'CASE … WHEN', node: 'CaseExpr', type: 'rng', values: R.slice(0, 2), sql: (_, v) => `SELECT CASE ${v(0)} WHEN ${v(1)} THEN 1 ELSE 0 END` },
  { name: 'ORDER BY', node: 'SortBy', type: 'rng', values: R.slice(0, 2), sql: (_, v) => `SELECT x FROM (VALUES (${v(1)}), (${v(0)})) v(x) ORDER BY x` },
  { name: 'DISTINCT', node: 'SelectStmt (distinctClause)', type: 'rng', values: R.slice(0, 2), sql: (_, v) => `SELECT DISTINCT x FROM (VALUES (${v(0)}), (${v(1)})) v(x)` },
  { name: 'GROUP BY', node: 'SelectStmt (groupClause)', type: 'rng', values: R.slice(0, 2), sql: (_, v) => `SELECT x FROM (VALUES (${v(0)}), (${v(1)})) v(x) GROUP BY x` },
  { name: 'UNION', node: 'SelectStmt (op UNION)', type: 'rng', values: R.slice(0, 2), sql: (_, v) => `SELECT ${v(0)} UNION SELECT ${v(1)}` },
  { name: 'recursive CTE … CYCLE', node: 'CTECycleClause', type: 'rng', values: R.slice(0, 1), sql: (_, v) => `WITH RECURSIVE w(x) AS (SELECT ${v(0)} UNION ALL SELECT x FROM w) CYCLE x SET c USING p SELECT x FROM w` },
  // Domain CHECKs.
  { name: "a domain's value (type 'literal', $1::domain, Parse's parameter type)", node: 'TypeCast / Parse parameter type', type: 'dom', values: ['x'], sql: (_, v) => `SELECT ${v(0)}` },
  { name: 'COALESCE of a domain value', node: 'CoalesceExpr', type: 'dom', values: ['x'], sql: (_, v) => `SELECT COALESCE(NULL, ${v(0)})` },
  { name: 'cast to a domain (::)', node: 'TypeCast', sql: (s) => `SELECT 'x'::${s}.dom` },
  { name: 'CAST(… AS domain)', node: 'TypeCast', sql: (s) => `SELECT CAST('x' AS ${s}.dom)` },
  { name: 'JSON_OBJECT … RETURNING domain', node: 'JsonObjectConstructor', sql: (s) => `SELECT JSON_OBJECT('a': 1 RETURNING ${s}.dom)` },
  { name: 'JSON_ARRAY … RETURNING domain', node: 'JsonArrayConstructor', sql: (s) => `SELECT JSON_ARRAY(1, 2 RETURNING ${s}.dom)` },
  { name: 'JSON_ARRAY(query RETURNING domain)', node: 'JsonArrayQueryConstructor', sql: (s) => `SELECT JSON_ARRAY(SELECT 1 RETURNING ${s}.dom)` },
  { name: 'JSON_OBJECTAGG … RETURNING domain', node: 'JsonObjectAgg', sql: (s) => `SELECT JSON_OBJECTAGG('a': 1 RETURNING ${s}.dom)` },
  { name: 'JSON_ARRAYAGG … RETURNING domain', node: 'JsonArrayAgg', sql: (s) => `SELECT JSON_ARRAYAGG(1 RETURNING ${s}.dom)` },
  { name: 'JSON_VALUE … RETURNING domain', node: 'JsonFuncExpr (JSON_VALUE)', values: ['"x"'], sql: (s, v) => `SELECT JSON_VALUE(${v(0)}, '$' RETURNING ${s}.dom)` },
  { name: 'JSON_QUERY … RETURNING domain', node: 'JsonFuncExpr (JSON_QUERY)', sql: (s) => `SELECT JSON_QUERY('"x"', '$' RETURNING ${s}.dom)` },
  { name: 'JSON_SERIALIZE … RETURNING domain', node: 'JsonSerializeExpr', sql: (s) => `SELECT JSON_SERIALIZE('1' RETURNING ${s}.dom)` },
  { name: 'JSON_TABLE, a column of the domain', node: 'JsonTable', values: ['["x"]'], sql: (s, v) => `SELECT * FROM JSON_TABLE(${v(0)}, '$[*]' COLUMNS (x ${s}.dom PATH '$'))` },
  { name: 'XMLTABLE, a column of the domain', node: 'RangeTableFunc', sql: (s) => `SELECT * FROM XMLTABLE('/a' PASSING '<a>x</a>' COLUMNS x ${s}.dom PATH '.')` },
  { name: 'XMLSERIALIZE … AS domain', node: 'XmlSerialize', sql: (s) => `SELECT XMLSERIALIZE(CONTENT '<a/>' AS ${s}.dom)` },
  // Type modifiers and binary output: functions of a base type that PL/pgSQL may be (set by ALTER TYPE).
  { name: "type modifier (PL/pgSQL typmod_in), in a cast", node: 'TypeCast (typmods)', sql: (s) => `SELECT 'x'::${s}.blob(3)` },
  { name: 'type modifier (PL/pgSQL typmod_in), in JSON_VALUE … RETURNING', node: 'JsonFuncExpr (typmods)', sql: (s) => `SELECT JSON_VALUE('"x"', '$' RETURNING ${s}.blob(3))` },
  { name: "COPY … (FORMAT binary): the type's PL/pgSQL send function", node: 'CopyStmt', sql: (s) => `COPY (SELECT 'x'::${s}.blob) TO STDOUT (FORMAT binary)` },
  { name: "a result column in binary (Bind's result format): the type's PL/pgSQL send function", node: 'Bind (result format)', type: 'blob', values: ['x'], ways: ['raw'], binary: true, sql: (_, v) => `SELECT ${v(0)}` },
  { name: 'INSERT into a column of the domain', node: 'InsertStmt', values: ['x'], sql: (s, v) => `INSERT INTO ${s}.t_dom VALUES (${v(0)})`, setup: (s) => [`CREATE TABLE ${s}.t_dom (d ${s}.dom)`] },
  // Casts (CREATE CAST … WITH FUNCTION).
  { name: 'cast (::) WITH FUNCTION', node: 'TypeCast', sql: (s) => `SELECT 1::${s}.pair` },
  { name: 'CAST() WITH FUNCTION', node: 'TypeCast', sql: (s) => `SELECT CAST(1 AS ${s}.pair)` },
  { name: 'assignment cast (INSERT an int into a column of the type)', node: 'InsertStmt', sql: (s) => `INSERT INTO ${s}.t_cast VALUES (1)`, setup: (s) => [`CREATE TABLE ${s}.t_cast (p ${s}.pair)`] },
  // What a table, view or index holds.
  { name: 'column DEFAULT (INSERT … DEFAULT VALUES)', node: 'InsertStmt', sql: (s) => `INSERT INTO ${s}.t_default DEFAULT VALUES`, setup: (s) => [`CREATE TABLE ${s}.t_default (x int DEFAULT ${s}.f(1))`] },
  { name: 'generated column (STORED)', node: 'InsertStmt', values: [1], sql: (s, v) => `INSERT INTO ${s}.t_generated (x) VALUES (${v(0)})`, setup: (s) => [`CREATE TABLE ${s}.t_generated (x int, g int GENERATED ALWAYS AS (${s}.imm(x)) STORED)`] },
  { name: 'CHECK constraint', node: 'InsertStmt', values: [1], sql: (s, v) => `INSERT INTO ${s}.t_check VALUES (${v(0)})`, setup: (s) => [`CREATE TABLE ${s}.t_check (x int CHECK (${s}.ok(x)))`] },
  { name: 'index expression (IMMUTABLE PL/pgSQL)', node: 'InsertStmt', values: [1], sql: (s, v) => `INSERT INTO ${s}.t_expr_index VALUES (${v(0)})`, setup: (s) => [`CREATE TABLE ${s}.t_expr_index (x int)`, `CREATE INDEX ON ${s}.t_expr_index (${s}.imm(x))`] },
  {
    name: 'btree index of the custom type (keys compared on INSERT)',
    node: 'InsertStmt',
    sql: (s) => `INSERT INTO ${s}.t_rng_index VALUES ('[5,)')`,
    setup: (s) => [`CREATE TABLE ${s}.t_rng_index (r ${s}.rng)`, `CREATE INDEX ON ${s}.t_rng_index (r)`, `INSERT INTO ${s}.t_rng_index VALUES ('[1,)')`],
  },
  {
    name: 'foreign key check over the custom type (runs as the table owner)',
    node: 'InsertStmt (RI trigger)',
    sql: (s) => `INSERT INTO ${s}.t_fk VALUES ('[1,)')`,
    setup: (s) => [`CREATE TABLE ${s}.t_fk_target (r ${s}.rng PRIMARY KEY)`, `INSERT INTO ${s}.t_fk_target VALUES ('[1,)')`, `CREATE TABLE ${s}.t_fk (r ${s}.rng REFERENCES ${s}.t_fk_target)`],
  },
  {
    name: 'BEFORE INSERT trigger',
    node: 'InsertStmt',
    sql: (s) => `INSERT INTO ${s}.t_trigger VALUES (1)`,
    setup: (s) => [`CREATE TABLE ${s}.t_trigger (x int)`, `CREATE TRIGGER code_forms BEFORE INSERT ON ${s}.t_trigger FOR EACH ROW EXECUTE FUNCTION ${s}.trig()`],
  },
  {
    name: 'rule ON INSERT DO ALSO',
    node: 'InsertStmt',
    sql: (s) => `INSERT INTO ${s}.t_rule VALUES (1)`,
    setup: (s) => [`CREATE TABLE ${s}.t_rule (x int)`, `CREATE TABLE ${s}.t_rule_log (x int)`, `CREATE RULE code_forms AS ON INSERT TO ${s}.t_rule DO ALSO INSERT INTO ${s}.t_rule_log VALUES (${s}.f(NEW.x))`],
  },
  {
    name: 'row-level security policy (USING, on a SELECT)',
    node: 'RangeVar',
    sql: (s) => `SELECT x FROM ${s}.t_policy`,
    setup: (s) => [`CREATE TABLE ${s}.t_policy (x int)`, `INSERT INTO ${s}.t_policy VALUES (1)`, `ALTER TABLE ${s}.t_policy ENABLE ROW LEVEL SECURITY`, `CREATE POLICY code_forms ON ${s}.t_policy FOR SELECT USING (${s}.ok(x))`],
  },
  { name: "view whose target list calls the function (a view is an ON SELECT rule)", node: 'RangeVar', sql: (s) => `SELECT x FROM ${s}.v_call`, setup: (s) => [`CREATE VIEW ${s}.v_call AS SELECT ${s}.f(1) AS x`] },
  { name: 'COPY (SELECT … FROM view) TO STDOUT', node: 'CopyStmt', sql: (s) => `COPY (SELECT x FROM ${s}.v_call) TO STDOUT` },
  {
    name: "planner's selectivity estimate (a range type's subtype_diff, from ANALYZE's histogram)",
    node: 'RangeVar + A_Expr (planner)',
    sql: (s) => `SELECT count(*) FROM ${s}.t_spans WHERE r && '[1,5)'`,
    setup: (s) => [`CREATE TABLE ${s}.t_spans (r ${s}.span)`, `INSERT INTO ${s}.t_spans SELECT ${s}.span(i, i + i % 7 + 1) FROM generate_series(1, 2000) i`, `ANALYZE ${s}.t_spans`],
  },
]

/** What PostgreSQL 18 does not let us express (or runs only in C), so the corpus leaves it out. */
export const NOT_EXPRESSIBLE = [
  "a base type's input and output functions: they take or return cstring, which PL/pgSQL and SQL functions may not (C only; here LANGUAGE internal aliases of textin/textout)",
  "a base type's receive and analyze functions, and a subscripting handler (CREATE TYPE … SUBSCRIPT): they take internal (C only)",
  "a base type's typmod_out: returns cstring (C only); its typmod_in and send may be PL/pgSQL (ALTER TYPE … SET, superuser): in the corpus",
  "a range type's canonical function in PL/pgSQL: refused (PL/pgSQL functions cannot return a shell type), C only",
  "a range type's subtype_diff in PL/pgSQL: allowed, run by GiST and the planner: in the corpus through the planner's selectivity estimate",
  'a VIRTUAL generated column calling a function of ours: refused ("generation expression uses user-defined function")',
  "JSON_EXISTS, JSON() and JSON_SCALAR … RETURNING: no such clause in PostgreSQL 18's grammar",
  'COPY view TO STDOUT: refused ("cannot copy from view"); COPY (SELECT … FROM view) TO STDOUT is in the corpus',
]

/** The attacker's objects: the log, leave(), the hooks, and each form's own; then the grants to `roles`. */
export function setupSql(s: string, roles: Record<EffectKey, string>): string[] {
  const all = Object.values(roles).join(', ')
  /** A PL/pgSQL function in `schema` that runs leave(), then `result`. */
  const hook = (signature: string, returns: string, result: string, extra = '', schema = s) =>
    `CREATE FUNCTION ${schema}.${signature} RETURNS ${returns} LANGUAGE plpgsql ${extra} AS $f$ BEGIN PERFORM ${s}.leave(); ${result}; END $f$`
  const branches = EFFECTS.map((e, i) => `${i ? 'ELSIF' : 'IF'} session_user::text = '${roles[e.key]}' THEN ${e.body(s)}`).join('\n      ')
  return [
    `CREATE SCHEMA ${s}`,
    `CREATE TABLE ${s}.ran (pid int, query text)`,
    // (Only for the corpus's roles: ANALYZE in this setup, or autovacuum, may run a hook too.)
    `CREATE FUNCTION ${s}.leave() RETURNS void LANGUAGE plpgsql AS $f$
    BEGIN
      IF session_user::text NOT IN (${Object.values(roles).map((r) => `'${r}'`).join(', ')}) THEN RETURN; END IF;
      INSERT INTO ${s}.ran VALUES (pg_backend_pid(), current_query());
      ${branches}
      END IF;
    END $f$`,
    hook('f(x int)', 'int', 'RETURN x'),
    hook('imm(x int)', 'int', 'RETURN x', 'IMMUTABLE'),
    hook('ok(x anyelement)', 'boolean', 'RETURN true'),
    hook('srf(x int)', 'SETOF int', 'RETURN NEXT x'),
    hook('trig()', 'trigger', 'RETURN NEW'),
    hook('win()', 'int', 'RETURN 1', 'WINDOW'),
    hook('sfunc(state int, x int)', 'int', 'RETURN state + x'),
    `CREATE AGGREGATE ${s}.agg(int) (SFUNC = ${s}.sfunc, STYPE = int, INITCOND = '0')`,
    hook('eq(a int, b int)', 'boolean', 'RETURN a = b'),
    `CREATE OPERATOR ${s}.## (LEFTARG = int, RIGHTARG = int, FUNCTION = ${s}.eq)`,
    hook('neg(x int)', 'int', 'RETURN -x'),
    `CREATE OPERATOR ${s}.!! (RIGHTARG = int, FUNCTION = ${s}.neg)`,
    // A btree opclass for int whose comparison function is ours, and a range type over it.
    hook('cmp(a int, b int)', 'int', 'RETURN btint4cmp(a, b)', 'IMMUTABLE'),
    ...[['lt', '<'], ['le', '<='], ['same', '='], ['ge', '>='], ['gt', '>']].flatMap(([f, op]) => [
      `CREATE FUNCTION ${s}.${f}(a int, b int) RETURNS boolean LANGUAGE sql IMMUTABLE AS 'SELECT a ${op} b'`,
      `CREATE OPERATOR ${s}.#${op} (LEFTARG = int, RIGHTARG = int, FUNCTION = ${s}.${f})`,
    ]),
    `CREATE OPERATOR CLASS ${s}.int_ops FOR TYPE int USING btree AS
      OPERATOR 1 ${s}.#<, OPERATOR 2 ${s}.#<=, OPERATOR 3 ${s}.#=, OPERATOR 4 ${s}.#>=, OPERATOR 5 ${s}.#>, FUNCTION 1 ${s}.cmp(int, int)`,
    `CREATE TYPE ${s}.rng AS RANGE (SUBTYPE = int, SUBTYPE_OPCLASS = ${s}.int_ops)`,
    hook('diff(a int, b int)', 'float8', 'RETURN a - b', 'IMMUTABLE'),
    `CREATE TYPE ${s}.span AS RANGE (SUBTYPE = int, SUBTYPE_DIFF = ${s}.diff)`,
    `CREATE DOMAIN ${s}.dom AS text CHECK (${s}.ok(VALUE))`,
    `CREATE TYPE ${s}.pair AS (a int, b int)`,
    hook('to_pair(x int)', `${s}.pair`, 'RETURN ROW(x, x)'),
    `CREATE CAST (int AS ${s}.pair) WITH FUNCTION ${s}.to_pair(int) AS ASSIGNMENT`,
    // A base type (text's representation, C input and output), its typmod_in and send ours.
    `CREATE TYPE ${s}.blob`,
    `CREATE FUNCTION ${s}.blob_in(cstring) RETURNS ${s}.blob LANGUAGE internal IMMUTABLE STRICT AS 'textin'`,
    `CREATE FUNCTION ${s}.blob_out(${s}.blob) RETURNS cstring LANGUAGE internal IMMUTABLE STRICT AS 'textout'`,
    `CREATE TYPE ${s}.blob (INPUT = ${s}.blob_in, OUTPUT = ${s}.blob_out, LIKE = text)`,
    `CREATE CAST (${s}.blob AS text) WITHOUT FUNCTION`,
    hook(`blob_send(x ${s}.blob)`, 'bytea', 'RETURN textsend(x::text)', 'IMMUTABLE'),
    hook('blob_typmod(x cstring[])', 'int', 'RETURN 3', 'IMMUTABLE'),
    `ALTER TYPE ${s}.blob SET (SEND = ${s}.blob_send, TYPMOD_IN = ${s}.blob_typmod)`,
    // Each role's own schema, "$user" on its default search_path: where an unqualified call finds ours.
    ...Object.values(roles).flatMap((role) => [`CREATE SCHEMA ${role}`, `GRANT USAGE ON SCHEMA ${role} TO ${role}`, hook('code_forms_call()', 'int', 'RETURN 1', '', role)]),
    ...FORMS.flatMap((f) => f.setup?.(s) ?? []),
    `GRANT USAGE ON SCHEMA ${s} TO ${all}`,
    `GRANT SELECT, INSERT ON ALL TABLES IN SCHEMA ${s} TO ${all}`,
  ]
}

export function teardownSql(s: string, roles: Record<EffectKey, string>): string[] {
  return [`DROP SCHEMA IF EXISTS ${s} CASCADE`, ...Object.values(roles).flatMap((r) => [`DROP SCHEMA IF EXISTS ${r} CASCADE`, `DROP OWNED BY ${r}`, `DROP ROLE ${r}`])]
}

export interface Entry {
  n: number
  form: Form
  effect: Effect
  way: Way
  /** What session A sends (its text begins with `marker`, which leave() logs with current_query()). */
  text: string
  values: Array<string | number>
  /** raw only: the parameters' type OIDs, in Parse; results in binary. */
  types: number[]
  binary: boolean
  marker: string
}

/** Every form × effect × way that applies (raw: forms of a custom type). */
export function buildEntries(s: string, oids: Record<TypeKey, number>): Entry[] {
  const out: Entry[] = []
  for (const form of FORMS) {
    for (const effect of EFFECTS) {
      for (const way of form.ways ?? (['simple', 'extended', 'raw', 'http'] as Way[])) {
        if (way === 'raw' && !form.type) continue
        const n = out.length
        const values = form.values ?? []
        const v = (i: number) => {
          const value = values[i]
          if (way === 'simple') return form.type ? `${s}.${form.type} '${value}'` : typeof value === 'number' ? String(value) : `'${value}'`
          return way === 'raw' || !form.type ? `$${i + 1}` : `$${i + 1}::${s}.${form.type}`
        }
        const marker = `/* code-forms #${n} */`
        out.push({
          n,
          form,
          effect,
          way,
          marker,
          text: `${marker} ${form.sql(s, v)}`,
          values: way === 'simple' ? [] : values,
          types: way === 'raw' ? values.map(() => oids[form.type!]) : [],
          binary: way === 'raw' && !!form.binary,
        })
      }
    }
  }
  return out
}

/**
 * What a backend holds that a session could leave for the next one, from Postgres's own catalogs:
 * one JSON text. (Unqualified names are safe: pg_catalog is searched first whatever search_path says.)
 */
export const PROBE_SQL = `SELECT json_build_object(
  'pid', pg_backend_pid(), 'current_user', current_user, 'session_user', session_user,
  'search_path', current_setting('search_path'),
  'temp', (SELECT count(*) FROM pg_class WHERE relnamespace = pg_my_temp_schema()),
  'listening', ARRAY(SELECT c FROM pg_listening_channels() c ORDER BY 1),
  'locks', (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()),
  'prepared', ARRAY(SELECT name FROM pg_prepared_statements WHERE from_sql ORDER BY 1),
  'cursors', ARRAY(SELECT name FROM pg_cursors WHERE is_holdable ORDER BY 1))::text AS probe`

export interface Probe {
  pid: number
  current_user: string
  session_user: string
  search_path: string
  temp: number
  listening: string[]
  locks: number
  prepared: string[]
  cursors: string[]
}

/** What `probe` holds that `baseline` (a fresh backend's probe, same role) does not: ["search_path: …", …]. */
export function differences(probe: Probe, baseline: Probe): string[] {
  return (Object.keys(baseline) as Array<keyof Probe>)
    .filter((k) => k !== 'pid' && JSON.stringify(probe[k]) !== JSON.stringify(baseline[k]))
    .map((k) => `${k}: ${JSON.stringify(probe[k])}`)
}

/** Whether `probe` shows `effect` (what leave() leaves for that role). */
export function shows(probe: Probe, effect: Effect, s: string): boolean {
  return effect.key === 'path' ? probe.search_path === `${s}, public` : probe.temp > 0 && probe.locks > 0 && probe.listening.includes('code_forms')
}

// ── raw protocol ─────────────────────────────────────────────────────────────────────────────

const int16 = (n: number) => {
  const b = Buffer.alloc(2)
  b.writeInt16BE(n)
  return b
}

/** Parse (unnamed, parameter types `oids`) + Bind (text values; results in text, or `binary`) + Execute + Sync. */
export function typedQuery(sql: string, oids: number[], values: Array<string | number>, binary = false): Buffer {
  const texts = values.map((v) => Buffer.from(String(v)))
  return Buffer.concat([
    message('P', Buffer.concat([cstrings(['', sql]), int16(oids.length), ...oids.map(int32)])),
    message('B', Buffer.concat([cstrings(['', '']), int16(0), int16(texts.length), ...texts.flatMap((t) => [int32(t.length), t]), ...(binary ? [int16(1), int16(1)] : [int16(0)])])),
    message('E', Buffer.concat([cstrings(['']), int32(0)])),
    message('S', Buffer.alloc(0)),
  ])
}
