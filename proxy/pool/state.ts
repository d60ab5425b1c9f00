/**
 * What a statement may leave behind on its backend, read from its text: the first step in deciding
 * whether a backend can serve another session after a transaction (transaction pooling).
 *
 * The reading is conservative. `sets` is true for what sets session state in plain sight (SET,
 * PREPARE, LISTEN, a WITH HOLD cursor, a temporary object, set_config(…, false), a session advisory
 * lock…). `runs` is true wherever code the proxy cannot read may run (a function it does not know
 * to be harmless, DO, CALL): that code may set anything, also what no catalog lists (a custom
 * setting's placeholder). `reads` is true for a statement that touches relations, where triggers,
 * rules, policies and views may run code: whether any exist is the database's to say, not the
 * text's. A statement is harmless only with all three false, or `reads` alone in a database that
 * runs no such code.
 */
export interface StatementEffects {
  sets: boolean
  runs: boolean
  reads: boolean
  /** DDL: what the database runs by itself may have changed. */
  ddl: boolean
  /** It may call nextval(), after which currval() and lastval() answer for this backend. */
  sequences: boolean
}

/** A statement that leaves nothing behind. */
export const NOTHING: StatementEffects = { sets: false, runs: false, reads: false, ddl: false, sequences: false }

/** What either of two statements may leave behind. */
export function merge(a: StatementEffects, b: StatementEffects): StatementEffects {
  if (b === NOTHING) return a
  return { sets: a.sets || b.sets, runs: a.runs || b.runs, reads: a.reads || b.reads, ddl: a.ddl || b.ddl, sequences: a.sequences || b.sequences }
}

/**
 * What a transaction whose statements had effects `e` may have left on its backend: state set in
 * plain sight, state set by code the database runs (`runsCode`: whether it has any; undefined, not
 * known), `unknown` where only the database can say, or undefined: nothing. DDL in the transaction
 * may have made such code, and its later statements run it: then only the database can say.
 */
export function leftBehind(e: StatementEffects, runsCode: boolean | undefined): 'state' | 'code' | 'unknown' | undefined {
  if (e.sets) return 'state'
  if (e.runs) return 'code'
  if (!e.reads) return undefined
  return runsCode === undefined || e.ddl ? 'unknown' : runsCode ? 'code' : undefined
}

/** Built-in functions that leave no session state behind (reading a setting is fine). */
const HARMLESS = new Set(
  `abs array_agg array_append array_cat array_length array_position array_prepend array_remove array_to_string avg bool_and bool_or btrim
  cardinality ceil ceiling char_length character_length chr coalesce concat concat_ws count cume_dist current_database current_date
  current_schema current_setting current_time current_timestamp current_user date_part date_trunc decode dense_rank digest encode every
  exp extract first_value floor format gen_random_uuid generate_series greatest initcap json_agg json_array_elements json_array_length
  json_build_array json_build_object json_each json_extract_path json_extract_path_text json_object_agg json_typeof jsonb_agg
  jsonb_array_elements jsonb_array_length jsonb_build_array jsonb_build_object jsonb_each jsonb_extract_path jsonb_extract_path_text
  jsonb_insert jsonb_object_agg jsonb_path_query jsonb_pretty jsonb_set jsonb_strip_nulls jsonb_typeof lag last_value lead least left
  length ln localtime localtimestamp log lower lpad ltrim make_date make_interval make_timestamp make_timestamptz max md5 min mod
  now nth_value ntile nullif octet_length overlay percent_rank percentile_cont percentile_disc pg_backend_pid pg_sleep position power
  quote_ident quote_literal quote_nullable random rank regexp_match regexp_matches regexp_replace regexp_split_to_array
  regexp_split_to_table repeat replace reverse right round row_number row_to_json rpad rtrim session_user sign split_part sqrt
  starts_with statement_timestamp string_agg string_to_array strpos substr substring sum timezone to_char to_date to_json to_jsonb
  to_number to_timestamp transaction_timestamp translate trim trunc unnest upper user uuid_generate_v4 version width_bucket`.split(/\s+/)
)

/** Built-in functions that set session state. */
const SETS_STATE = /^(set_config|pg_advisory_lock(_shared)?|pg_try_advisory_lock(_shared)?|dblink_connect(_u)?|pg_notification_queue_usage)$/
/** Words before '(' that are not function calls. */
const NOT_CALLS = new Set(
  `all and any array as between by case cast check coalesce constraint cube decimal default distinct do else end exists filter float from
  grouping having if in interval into is join key lateral like not numeric on only or over partition primary privileges references
  returning rollup row select set some then time timestamp to unique using values varchar char character bit varying when where window
  with within conflict`.split(/\s+/)
)
const TRANSACTION = new Set(['begin', 'start', 'commit', 'end', 'rollback', 'abort', 'savepoint', 'release'])
const READS = new Set(['select', 'with', 'values', 'table', 'insert', 'update', 'delete', 'merge', 'copy'])
const DDL = new Set(['create', 'alter', 'drop', 'comment', 'grant', 'revoke', 'truncate', 'security', 'reindex', 'cluster', 'vacuum', 'analyze', 'refresh', 'import'])

type Token = { word?: string; punct?: string }

/** Words (lowercased; quoted identifiers as written) and punctuation; literals, comments and dollar-quoted bodies left out. */
export function tokens(sql: string): Token[] {
  const out: Token[] = []
  for (let i = 0; i < sql.length; ) {
    const c = sql[i]
    if (/\s/.test(c)) i++
    else if (c === '-' && sql[i + 1] === '-') {
      const newline = sql.indexOf('\n', i)
      i = newline < 0 ? sql.length : newline + 1
    }
    else if (c === '/' && sql[i + 1] === '*') {
      let depth = 0
      do {
        if (sql.startsWith('/*', i)) (depth++, (i += 2))
        else if (sql.startsWith('*/', i)) (depth--, (i += 2))
        else i++
      } while (depth > 0 && i < sql.length)
    } else if (c === "'" || ((c === 'e' || c === 'E') && sql[i + 1] === "'")) {
      const escapes = c !== "'"
      i += escapes ? 2 : 1
      for (; i < sql.length; i++) {
        if (escapes && sql[i] === '\\') i++
        else if (sql[i] === "'") {
          if (sql[i + 1] === "'") i++
          else break
        }
      }
      i++
      out.push({ punct: "'" }) // a literal
    } else if (c === '"') {
      let j = i + 1
      for (; j < sql.length; j++) if (sql[j] === '"' && sql[++j] !== '"') break
      out.push({ word: sql.slice(i + 1, j - 1).replace(/""/g, '"') })
      i = j
    } else if (c === '$' && /^\$([A-Za-z_][\w]*)?\$/.test(sql.slice(i))) {
      const tag = /^\$([A-Za-z_][\w]*)?\$/.exec(sql.slice(i))![0]
      const end = sql.indexOf(tag, i + tag.length)
      i = end < 0 ? sql.length : end + tag.length
      out.push({ punct: "'" }) // a body: a string, to whatever runs it
    } else if (/[A-Za-z_\u0080-\uffff]/.test(c)) {
      const m = /^[A-Za-z_\u0080-\uffff][\w$\u0080-\uffff]*/.exec(sql.slice(i))![0]
      out.push({ word: m.toLowerCase() })
      i += m.length
    } else if (/\d/.test(c)) i += /^[\d.]+(e[+-]?\d+)?/i.exec(sql.slice(i))?.[0].length || 1
    else out.push({ punct: c }), i++
  }
  return out
}

/** Texts already read: applications send the same few again and again. */
const known = new Map<string, StatementEffects>()
const KNOWN_MAX = 2000

/** The effects of `sql`, which may hold several statements. */
export function effects(sql: string): StatementEffects {
  let e = known.get(sql)
  if (!e) {
    if (known.size >= KNOWN_MAX) known.clear()
    known.set(sql, (e = read(sql)))
  }
  return e
}

function read(sql: string): StatementEffects {
  let all = NOTHING
  let statement: Token[] = []
  const flush = () => {
    if (statement.length) all = merge(all, statementEffects(statement))
    statement = []
  }
  for (const t of tokens(sql)) t.punct === ';' ? flush() : statement.push(t)
  flush()
  return all
}

function statementEffects(ts: Token[]): StatementEffects {
  const e: StatementEffects = { sets: false, runs: false, reads: false, ddl: false, sequences: false }
  const words = ts.map((t) => t.word ?? '')
  const first = words[0]
  const has = (...w: string[]) => w.some((x) => words.includes(x))
  if (TRANSACTION.has(first)) return calls(ts, e)
  switch (first) {
    case 'set':
      // SET LOCAL, SET TRANSACTION and SET CONSTRAINTS last until the transaction ends.
      e.sets = !(words[1] === 'local' || words[1] === 'transaction' || words[1] === 'constraints')
      return calls(ts, e)
    case 'reset':
    case 'prepare':
    case 'deallocate':
    case 'listen':
    case 'unlisten':
    case 'load':
    case 'discard':
      e.sets = true
      return e
    case 'declare':
      e.sets = has('hold') && words[words.indexOf('hold') - 1] === 'with'
      e.reads = true
      return calls(ts, e)
    case 'do':
    case 'call':
      e.runs = true
      return e
    case 'show':
      return e
    case 'explain':
      // EXPLAIN ANALYZE runs the statement.
      e.reads = true
      e.runs = has('analyze')
      return calls(ts, e)
    case 'fetch':
    case 'move':
    case 'close':
    case 'lock':
    case 'checkpoint':
    case 'notify':
      return calls(ts, e)
  }
  if (DDL.has(first)) {
    e.sets = first === 'create' && (has('temp', 'temporary') || has('pg_temp'))
    e.ddl = !e.sets // (a temporary object is the session's alone: nothing the database runs for others changes)
    e.runs = true // (event triggers, and the functions a definition may run at once: a default, an index expression)
    return e
  }
  if (READS.has(first)) {
    // SELECT 1 touches no relation; FROM, or writing one, does.
    e.reads = !(first === 'select' || first === 'values' || first === 'with') || has('from', 'insert', 'update', 'delete', 'merge')
    // INSERT and UPDATE run column defaults; nextval may be among them.
    e.sequences = first === 'insert' || first === 'update' || first === 'merge' || first === 'copy'
    return calls(ts, e)
  }
  e.runs = true // a statement the proxy does not know
  return e
}

/** Function calls in a statement: harmless ones, ones that set state, and the rest (code that may do anything). */
function calls(ts: Token[], e: StatementEffects): StatementEffects {
  for (let i = 0; i + 1 < ts.length; i++) {
    const name = ts[i].word
    if (!name || ts[i + 1].punct !== '(' || NOT_CALLS.has(name)) continue
    const before = ts[i - 1]
    // A type's modifier (::varchar(10)); a table's or an alias's column list (INTO t (a, b), AS t (a, b)); a CTE's (, c (x) AS).
    if (before?.punct === ':' || before?.word === 'into' || before?.word === 'as' || (ts[i + 2] && closesBeforeAs(ts, i + 1))) continue
    // A qualified call: pg_catalog.lower( is lower(; any other schema's is code the proxy cannot read.
    if (before?.punct === '.' && ts[i - 2]?.word !== 'pg_catalog') {
      e.runs = true
      continue
    }
    if (SETS_STATE.test(name)) {
      // set_config(name, value, true) lasts until the transaction ends; anything else, past it.
      e.sets ||= !(name === 'set_config' && localSetConfig(ts, i + 1))
    } else if (name === 'nextval' || name === 'setval') e.sequences = true
    else if (!HARMLESS.has(name)) e.runs = true
  }
  return e
}

/** Whether the parenthesis at `open` closes right before AS ( : a CTE's column list. */
function closesBeforeAs(ts: Token[], open: number): boolean {
  let depth = 0
  for (let i = open; i < ts.length; i++) {
    if (ts[i].punct === '(') depth++
    else if (ts[i].punct === ')' && --depth === 0) return ts[i + 1]?.word === 'as' && ts[i + 2]?.punct === '('
  }
  return false
}

/** Whether the set_config( at `open` ends with a third argument of plain `true`. */
function localSetConfig(ts: Token[], open: number): boolean {
  let depth = 0
  let args = 1
  for (let i = open; i < ts.length; i++) {
    const p = ts[i].punct
    if (p === '(') depth++
    else if (p === ')' && --depth === 0) return args === 3 && ts[i - 1]?.word === 'true' && ts[i - 2]?.punct === ','
    else if (p === ',' && depth === 1) args++
  }
  return false
}
