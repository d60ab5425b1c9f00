/**
 * What a statement may leave behind on its backend, read with Postgres's own grammar (libpg-query:
 * the PostgreSQL 18 parser compiled to WebAssembly). The first of three readings that decide whether
 * a session keeps its backend for state it made (transaction pooling); the others are Postgres's
 * command tags and its catalogs (proxy/isolation/verify.ts). Whether a backend may serve another
 * session it never decides: every handover is reset. Conservative: what it cannot parse is not plain.
 */
import { loadModule, parseSync } from 'libpg-query'

export interface Reading {
  /** Leaves nothing behind by itself: plain reads and writes, transaction control, SHOW, SET LOCAL… */
  plain: boolean
  /** May run code of the database's own (a relation, an operator, a cast, a function call): triggers, rules, policies… (a description: no decision rests on it) */
  code: boolean
  /** Sets what no catalog shows (a custom setting's placeholder, setseed, LOAD, dblink): the backend stays the session's. */
  unseen: boolean
  /** Transaction control or COPY: the transaction may go on past the message, or Postgres wait for data (nothing of the proxy's may ride right behind it). */
  control: boolean
  /** COPY … FROM STDIN: Postgres waits for the client's data, and takes nothing else meanwhile. */
  copyIn?: boolean
  /** pg_cancel_backend / pg_terminate_backend of a constant or a parameter ($n): what the proxy acts on (proxy/ws/signals.ts). */
  signals?: Signal[]
  /** Something other than a read (SELECT without FOR UPDATE or INTO, SHOW): a standby would refuse it, or it may change what follows. */
  writes?: boolean
  /** The first statement opens a transaction block: 'read-only' (a hot standby can run it: READ ONLY, not SERIALIZABLE), else 'other'. */
  begins?: 'read-only' | 'other'
  /** Where the statements leave the transaction block, by the last that opens or ends one (none: where it was). */
  block?: 'open' | 'closed'
}

export interface Signal {
  kind: 'cancel' | 'terminate'
  /** The processID, or the parameter that holds it (1 for $1). */
  pid?: number
  param?: number
}

export const NOTHING: Reading = { plain: true, code: false, unseen: false, control: false }
const UNPARSED: Reading = { plain: false, code: true, unseen: false, control: true, writes: true, copyIn: true }

/** What either of two readings may leave. */
export function merge(a: Reading, b: Reading): Reading {
  if (b === NOTHING) return a
  if (a === NOTHING) return b
  const signals = a.signals || b.signals ? [...(a.signals ?? []), ...(b.signals ?? [])] : undefined
  const block = b.block ?? a.block
  return {
    plain: a.plain && b.plain, code: a.code || b.code, unseen: a.unseen || b.unseen, control: a.control || b.control, writes: a.writes || b.writes,
    ...((a.copyIn || b.copyIn) && { copyIn: true }), ...(signals && { signals }), ...(block && { block }), // (`begins` is the first statement's: routing reads it there)
  }
}

let loaded = false
/** Loads the parser (once, at the proxy's start): until then every statement reads as not plain. */
export async function loadReader(): Promise<void> {
  if (loaded) return
  await loadModule()
  loaded = true
  for (const sql of WARM_UP) readNow(sql)
}

/**
 * Read once at the start, not kept: the parser's first statements of each kind cost milliseconds
 * (WebAssembly compiled on first call), which would otherwise fall on the first sessions served.
 */
const WARM_UP = [
  "SELECT a.x, count(*) FROM t a JOIN u ON u.id = a.id WHERE a.y = $1::int AND a.z IN (1, 2) GROUP BY 1 ORDER BY 2 DESC LIMIT 10",
  "INSERT INTO t (a, b) VALUES ($1, 'x') ON CONFLICT (a) DO UPDATE SET b = excluded.b RETURNING *",
  'UPDATE t SET a = a + 1 WHERE id = $1',
  'DELETE FROM t WHERE id = $1',
  'BEGIN; SET LOCAL statement_timeout = 1000; COMMIT',
  'WITH w AS (SELECT 1) SELECT * FROM w',
]

/** Built-in functions that leave no session state (reading a setting, or the catalogs, is fine). Any other is checked by the backend. */
const HARMLESS = new Set(
  `abs acos age array_agg array_append array_cat array_dims array_fill array_length array_lower array_ndims array_position array_positions
  array_prepend array_remove array_replace array_to_json array_to_string array_upper ascii asin atan atan2 avg bit_and bit_length bit_or
  bool_and bool_or btrim cardinality cbrt ceil ceiling char_length character_length chr clock_timestamp coalesce col_description concat
  concat_ws cos cot count cume_dist current_database current_date current_schema current_schemas current_setting current_time
  current_timestamp current_user date_bin date_part date_trunc decode degrees dense_rank digest div encode every exp extract factorial
  first_value floor format format_type gen_random_uuid generate_series generate_subscripts greatest has_any_column_privilege
  has_column_privilege has_database_privilege has_function_privilege has_schema_privilege has_sequence_privilege has_table_privilege
  has_type_privilege hashtext initcap isfinite json_agg json_array_elements json_array_elements_text json_array_length json_build_array
  json_build_object json_each json_each_text json_extract_path json_extract_path_text json_object json_object_agg json_object_keys
  json_populate_record json_populate_recordset json_strip_nulls json_to_record json_to_recordset json_typeof jsonb_agg jsonb_array_elements
  jsonb_array_elements_text jsonb_array_length jsonb_build_array jsonb_build_object jsonb_each jsonb_each_text jsonb_extract_path
  jsonb_extract_path_text jsonb_insert jsonb_object jsonb_object_agg jsonb_object_keys jsonb_path_exists jsonb_path_match jsonb_path_query
  jsonb_path_query_array jsonb_path_query_first jsonb_populate_record jsonb_populate_recordset jsonb_pretty jsonb_set jsonb_set_lax
  jsonb_strip_nulls jsonb_to_record jsonb_to_recordset jsonb_typeof justify_days justify_hours justify_interval lag last_value lead least
  left length ln localtime localtimestamp log log10 lower lpad ltrim make_date make_interval make_time make_timestamp make_timestamptz max
  md5 min mod now nth_value ntile nullif num_nonnulls num_nulls obj_description octet_length overlay percent_rank percentile_cont
  percentile_disc pg_backend_pid pg_column_size pg_database_size pg_encoding_to_char pg_get_constraintdef pg_get_expr
  pg_get_function_arguments pg_get_function_identity_arguments pg_get_function_result pg_get_functiondef pg_get_indexdef pg_get_keywords
  pg_get_ruledef pg_get_serial_sequence pg_get_statisticsobjdef pg_get_triggerdef pg_get_userbyid pg_get_viewdef pg_has_role
  pg_indexes_size pg_is_in_recovery pg_postmaster_start_time pg_relation_size pg_size_pretty pg_sleep pg_table_is_visible pg_table_size
  pg_total_relation_size pg_type_is_visible pg_typeof pi position power quote_ident quote_literal quote_nullable radians random
  random_normal range_agg rank regexp_count regexp_instr regexp_like regexp_match regexp_matches regexp_replace regexp_split_to_array
  regexp_split_to_table regexp_substr repeat replace reverse right round row_number row_to_json rpad rtrim scale session_user sha224 sha256
  sha384 sha512 shobj_description sign sin split_part sqrt starts_with statement_timestamp stddev string_agg string_to_array
  string_to_table strpos substr substring sum tan timeofday timezone to_char to_date to_hex to_json to_jsonb to_number to_regclass
  to_regproc to_regprocedure to_regtype to_timestamp transaction_timestamp translate trim trunc txid_current unnest upper user
  uuid_generate_v4 uuidv4 uuidv7 variance version width_bucket xmlagg`.split(/\s+/)
)
/** Built-ins whose session state no catalog shows (advisory locks, settings and the rest are the backend's to tell). */
const UNSEEN = /^(setseed|dblink_connect(_u)?|dblink_open)$/
/** Settings that change how Postgres reads the statements after them: no reading of ours can follow. */
const LEXING = new Set(['standard_conforming_strings', 'client_encoding', 'backslash_quote', 'escape_string_warning'])
/** DECLARE … WITH HOLD (CURSOR_OPT_HOLD in parsenodes.h). */
const CURSOR_OPT_HOLD = 0x20
/** Statements that leave nothing by themselves (what they contain is read on). */
const PLAIN = new Set(['SelectStmt', 'InsertStmt', 'UpdateStmt', 'DeleteStmt', 'MergeStmt', 'TransactionStmt', 'VariableShowStmt', 'FetchStmt', 'LockStmt', 'CopyStmt', 'ExplainStmt', 'DeclareCursorStmt'])
const WRITES = new Set(['InsertStmt', 'UpdateStmt', 'DeleteStmt', 'MergeStmt', 'CopyStmt', 'LockStmt'])
/** Nodes through which the database's own code may run. */
const RUNS_CODE = new Set(['RangeVar', 'A_Expr', 'TypeCast', 'FuncCall', 'CallStmt', 'DoStmt', 'CopyStmt'])

/** Texts already read: applications send the same few again and again. */
const known = new Map<string, Reading>()
const KNOWN_MAX = 5000

/** What `sql` (one or several statements) may leave behind. */
export function read(sql: string): Reading {
  let r = known.get(sql)
  if (!r) {
    if (known.size >= KNOWN_MAX) known.clear()
    known.set(sql, (r = readNow(sql)))
  }
  return r
}

type Node = Record<string, unknown>

/**
 * The PREPARE that made statement `name`, cut by Postgres's grammar from `text`, the query string
 * Postgres records for it (which may hold other statements: only this one is made again). Undefined
 * where `text` holds no one PREPARE of that name (none, several, or text that does not parse).
 */
export function prepareIn(text: string, name: string): string | undefined {
  if (!loaded) return undefined
  let tree: { stmts?: Array<{ stmt?: { PrepareStmt?: { name?: string } }; stmt_location?: number; stmt_len?: number }> }
  try {
    tree = parseSync(text) as typeof tree
  } catch {
    return undefined
  }
  const bytes = Buffer.from(text) // (the parser's locations count bytes)
  let cut: string | undefined
  for (const { stmt, stmt_location: at = 0, stmt_len: len } of tree.stmts ?? []) {
    if (stmt?.PrepareStmt?.name !== name) continue
    if (cut !== undefined) return undefined
    cut = bytes.toString('utf8', at, len ? at + len : bytes.length)
  }
  return cut
}

function readNow(sql: string): Reading {
  if (!loaded) return UNPARSED
  let tree: { stmts?: Array<{ stmt?: Node }> }
  try {
    tree = parseSync(sql) as typeof tree
  } catch {
    return UNPARSED // (Postgres refuses it too, but not necessarily before its earlier statements ran)
  }
  const r: Reading = { ...NOTHING }
  for (const [i, { stmt }] of (tree.stmts ?? []).entries()) if (stmt) readStatement(stmt, r, i === 0)
  return r
}

function readStatement(stmt: Node, r: Reading, first: boolean) {
  const [kind, body] = Object.entries(stmt)[0] as [string, Node]
  if (!(kind === 'SelectStmt' && !body.lockingClause && !body.intoClause) && kind !== 'VariableShowStmt') r.writes = true
  if (kind === 'TransactionStmt') transaction(body, r, first)
  if (kind === 'VariableSetStmt') readSet(body, r)
  else if (!PLAIN.has(kind)) r.plain = false
  if (WRITES.has(kind)) r.code = true // (the relation written: its triggers, rules, defaults)
  if (kind === 'TransactionStmt' || kind === 'CopyStmt') r.control = true
  if (kind === 'CopyStmt' && body.is_from && !body.filename) r.copyIn = true
  if (kind === 'DeclareCursorStmt' && (Number(body.options) & CURSOR_OPT_HOLD) !== 0) r.plain = false
  else if (kind === 'LoadStmt') r.unseen = true
  walk(body, r)
  if (kind === 'CallStmt' || kind === 'DoStmt') r.code = true
}

/** Where a transaction statement leaves the block, and whether one that opens it a standby could run. */
function transaction(body: Node, r: Reading, first: boolean) {
  const kind = String(body.kind)
  const opens = kind === 'TRANS_STMT_BEGIN' || kind === 'TRANS_STMT_START'
  if (opens || body.chain === true) r.block = 'open'
  else if (kind === 'TRANS_STMT_COMMIT' || kind === 'TRANS_STMT_ROLLBACK' || kind === 'TRANS_STMT_PREPARE') r.block = 'closed'
  if (!opens || !first) return
  const option = (name: string) => ((body.options as Node[]) ?? []).map((o) => o.DefElem as Node).find((d) => d.defname === name)?.arg as Node | undefined
  const readOnly = ((option('transaction_read_only')?.A_Const as Node | undefined)?.ival as Node | undefined)?.ival === 1
  const isolation = ((option('transaction_isolation')?.A_Const as Node | undefined)?.sval as Node | undefined)?.sval
  r.begins = readOnly && isolation !== 'serializable' ? 'read-only' : 'other'
}

/** SET LOCAL and SET TRANSACTION last until the transaction ends; anything else, or a setting that changes lexing, does not leave it plain. */
function readSet(body: Node, r: Reading) {
  const name = String(body.name ?? '').toLowerCase()
  const local = body.is_local === true || name === 'transaction'
  if (!local || LEXING.has(name)) r.plain = false
  // A custom setting's placeholder, which no catalog lists; or lexing changed under the statements
  // after it, whose reading (of custom settings among the rest) cannot be trusted.
  if ((!local && name.includes('.')) || LEXING.has(name)) r.unseen = true
}

/** Every node under `node`: function calls, and where the database's code may run. */
function walk(node: unknown, r: Reading) {
  if (Array.isArray(node)) {
    for (const n of node) walk(n, r)
    return
  }
  if (!node || typeof node !== 'object') return
  for (const [key, value] of Object.entries(node as Node)) {
    if (RUNS_CODE.has(key)) r.code = true
    if (key === 'FuncCall') call(value as Node, r)
    if (key === 'intoClause') r.plain = false // (SELECT … INTO makes a table, anywhere in a set operation)
    if (value && typeof value === 'object') walk(value, r)
  }
}

function call(fn: Node, r: Reading) {
  const parts = ((fn.funcname as Array<{ String?: { sval?: string } }>) ?? []).map((p) => p.String?.sval ?? '')
  const name = parts[parts.length - 1]
  if (parts.length > 2 || (parts.length === 2 && parts[0] !== 'pg_catalog')) return void (r.plain = false)
  if (name === 'nextval' || name === 'setval') return // (their traces, currval() and lastval(), last while the backend stays with the session: a handover's reset drops them)
  if (UNSEEN.test(name)) r.unseen = true
  if (name === 'set_config') return setConfig(fn, r)
  if (name === 'pg_cancel_backend' || name === 'pg_terminate_backend') signal(name === 'pg_cancel_backend' ? 'cancel' : 'terminate', fn, r)
  if (!HARMLESS.has(name)) r.plain = false
}

/** A signal's target, where the statement names it: a constant, or a parameter (either perhaps cast). */
function signal(kind: Signal['kind'], fn: Node, r: Reading) {
  let arg = ((fn.args as Node[]) ?? [])[0]
  while (arg?.TypeCast) arg = (arg.TypeCast as Node).arg as Node
  const pid = ((arg?.A_Const as Node | undefined)?.ival as Node | undefined)?.ival
  const param = (arg?.ParamRef as Node | undefined)?.number
  if (typeof pid === 'number' || typeof param === 'number') (r.signals ??= []).push({ kind, ...(typeof pid === 'number' ? { pid } : { param: param as number }) })
}

/** set_config(name, value, true) lasts until the transaction ends; a custom name with any other third argument leaves a placeholder. */
function setConfig(fn: Node, r: Reading) {
  const args = (fn.args as Node[]) ?? []
  const isLocal = (args[2]?.A_Const as Node | undefined)?.boolval as Node | undefined
  const local = args.length === 3 && isLocal?.boolval === true
  const name = ((args[0]?.A_Const as Node | undefined)?.sval as Node | undefined)?.sval
  if (!local) r.plain = false
  if (!local && (typeof name !== 'string' || name.includes('.'))) r.unseen = true
  if (typeof name !== 'string' || LEXING.has(name.toLowerCase())) r.plain = false
  if (typeof name === 'string' && LEXING.has(name.toLowerCase())) r.unseen = true
}

/**
 * Command tags of statements that leave nothing by themselves: Postgres's own word on what ran, the
 * second reading. SET is not among them: SET LOCAL shares its tag with SET.
 */
const PLAIN_TAG = /^(SELECT|INSERT|UPDATE|DELETE|MERGE|FETCH|MOVE|COPY|BEGIN|START TRANSACTION|COMMIT|ROLLBACK|SAVEPOINT|RELEASE|SHOW|LOCK TABLE|EXPLAIN)( |$)/

/** Whether a CommandComplete's tag names a statement that leaves nothing by itself. */
export const plainTag = (tag: string) => PLAIN_TAG.test(tag)
