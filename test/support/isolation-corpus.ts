/**
 * The corpus of test/isolation-corpus.test.ts: statements that leave session state behind (and a
 * few that leave none), each in disguises an attacker would try, sent by simple query, extended
 * protocol, with a parameter, or as raw protocol messages. Generated deterministically: payloads ×
 * disguises × ways of sending. Every entry n uses names and advisory lock keys of its own, so an
 * entry never waits on another's lock and what one leaves is never taken for another's.
 */
import { cstrings, int32, message } from './protocol'

/** One thing session A sends: a query through an edgepg Client, or raw frontend messages. */
export type Step = { text: string; values?: unknown[]; extended?: boolean } | { raw: Buffer }

export interface Entry {
  n: number
  /** `payload × disguise × via`, unique. */
  name: string
  payload: string
  disguise: string
  via: 'simple' | 'extended' | 'param' | 'raw'
  /** Whether it is meant to leave state behind (false: innocent, it must run). */
  leaves: boolean
  /** An innocent entry's outcome: 'ok' unless Postgres refuses it (its SQLSTATE). */
  expect: string
  steps: Step[]
}

/** What the corpus needs from the database it runs on. */
export interface CorpusContext {
  /** A permanent sequence (for nextval → currval). */
  sequence: string
  /** A permanent table with one int column (for an innocent INSERT). */
  table: string
  /** Function OIDs for FunctionCall messages. */
  oids: { setConfig: number; advisoryLock: number; tryAdvisoryLock: number; backendPid: number }
}

/** The custom setting entry n may set (its placeholder). */
export const settingName = (n: number) => `corpus.e${n}`
/** The advisory lock key entry n may take. */
export const lockKey = (n: number) => 7_300_000 + n

/** An expression that leaves state, with the argument that names it (literal, or $1 with a value). */
interface Expr {
  name: string
  /** What it returns: where it may stand (an array slice bound needs an int cast). */
  castsToInt: boolean
  leaves: boolean
  call: (arg: string) => string
  arg: (n: number, ctx: CorpusContext) => { literal: string; param: string; value: unknown }
}

const EXPRS: Expr[] = [
  {
    name: 'set_config(…, false)',
    castsToInt: true, // (its value is '1')
    leaves: true,
    call: (a) => `set_config(${a}, '1', false)`,
    arg: (n) => ({ literal: `'${settingName(n)}'`, param: '$1', value: settingName(n) }),
  },
  {
    name: 'pg_advisory_lock',
    castsToInt: false, // (void: a cast fails, after the lock is taken)
    leaves: true,
    call: (a) => `pg_advisory_lock(${a})`,
    arg: (n) => ({ literal: String(lockKey(n)), param: '$1::bigint', value: lockKey(n) }),
  },
  {
    name: 'pg_try_advisory_lock',
    castsToInt: true,
    leaves: true,
    call: (a) => `pg_try_advisory_lock(${a})`,
    arg: (n) => ({ literal: String(lockKey(n)), param: '$1::bigint', value: lockKey(n) }),
  },
  {
    name: 'nextval',
    castsToInt: true,
    leaves: true,
    call: (a) => `nextval(${a})`,
    arg: (_, ctx) => ({ literal: `'${ctx.sequence}'`, param: '$1::text::regclass', value: ctx.sequence }),
  },
  {
    name: 'set_config(…, true)',
    castsToInt: true,
    leaves: false,
    call: (a) => `set_config(${a}, '1', true)`,
    arg: (n) => ({ literal: `'${settingName(n)}'`, param: '$1', value: settingName(n) }),
  },
]

/** Statements, each taking its entry's number n. */
interface Statement {
  name: string
  leaves: boolean
  /** Several statements: simple query only. */
  multi?: boolean
  sql: (n: number, ctx: CorpusContext) => string
}

const STATEMENTS: Statement[] = [
  { name: 'SET', leaves: true, sql: () => `SET work_mem = '1234kB'` },
  { name: 'SET SESSION CHARACTERISTICS', leaves: true, sql: () => 'SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL SERIALIZABLE' },
  { name: 'SET ROLE', leaves: true, sql: () => 'SET ROLE trust_user' },
  { name: 'SET SESSION AUTHORIZATION', leaves: true, sql: () => 'SET SESSION AUTHORIZATION trust_user' },
  { name: 'CREATE TEMP TABLE', leaves: true, sql: (n) => `CREATE TEMP TABLE corpus_t${n} (x int)` },
  { name: 'CREATE TEMP VIEW', leaves: true, sql: (n) => `CREATE TEMP VIEW corpus_v${n} AS SELECT 1 AS x` },
  { name: 'CREATE FUNCTION pg_temp', leaves: true, sql: (n) => `CREATE FUNCTION pg_temp.corpus_f${n}() RETURNS int LANGUAGE sql AS 'SELECT 1'` },
  { name: 'CREATE TEMP SEQUENCE + nextval', leaves: true, multi: true, sql: (n) => `CREATE TEMP SEQUENCE corpus_s${n}; SELECT nextval('corpus_s${n}')` },
  { name: 'CREATE TYPE pg_temp', leaves: true, sql: (n) => `CREATE TYPE pg_temp.corpus_ty${n} AS (a int)` },
  { name: 'CREATE OPERATOR pg_temp', leaves: true, sql: () => 'CREATE OPERATOR pg_temp.### (LEFTARG = int, RIGHTARG = int, FUNCTION = int4eq)' },
  { name: 'SELECT INTO TEMP, no FROM', leaves: true, sql: (n) => `SELECT 1 AS x INTO TEMP corpus_i${n}` },
  { name: 'SELECT INTO TEMP … FROM', leaves: true, sql: (n) => `SELECT x INTO TEMPORARY TABLE corpus_j${n} FROM generate_series(1, 2) x` },
  { name: 'DECLARE WITH HOLD', leaves: true, sql: (n) => `DECLARE corpus_c${n} CURSOR WITH HOLD FOR SELECT 1` },
  { name: 'DECLARE hold … WITH HOLD', leaves: true, sql: () => 'DECLARE hold CURSOR WITH HOLD FOR SELECT 1' },
  { name: 'PREPARE', leaves: true, sql: (n) => `PREPARE corpus_p${n} AS SELECT 1` },
  { name: 'LISTEN', leaves: true, sql: (n) => `LISTEN corpus_chan${n}` },
  ...EXPRS.filter((e) => e.name !== 'pg_try_advisory_lock').map((e) => ({
    name: `SELECT ${e.name}`,
    leaves: e.leaves,
    sql: (n: number, ctx: CorpusContext) => `SELECT ${e.call(e.arg(n, ctx).literal)}`,
  })),
  { name: 'SELECT 1', leaves: false, sql: () => 'SELECT 1 AS one' },
  { name: 'INSERT', leaves: false, sql: (_, ctx) => `INSERT INTO ${ctx.table} VALUES (1)` },
]

/**
 * Ways to hide a statement. `single`: the result is one statement (also sent by extended
 * protocol); otherwise several, by simple query only.
 */
interface StatementDisguise {
  name: string
  single: boolean
  wrap: (s: string) => string
  /** Sent by extended protocol as well (single statements only; a few, to bound the run time). */
  extended?: boolean
  /** Queries of their own ahead of it, in one transaction (COMMIT after). */
  before?: string[]
}

const STATEMENT_DISGUISES: StatementDisguise[] = [
  { name: 'plain', single: true, extended: true, wrap: (s) => s },
  { name: '-- comment ended by \\n', single: true, wrap: (s) => `-- note\n${s}` },
  { name: '-- comment ended by \\r', single: true, extended: true, wrap: (s) => `-- note\r${s}` },
  { name: '-- comment ended by \\r\\n', single: true, wrap: (s) => `-- note\r\n${s}` },
  { name: 'nested /* */ comment', single: true, wrap: (s) => `/* a /* b */ c */ ${s}` },
  { name: 'between two statements', single: false, wrap: (s) => `SELECT 1; ${s}; SELECT 2` },
  { name: 'after a $é$ string holding $$', single: false, wrap: (s) => `SELECT $é$ $$ $é$ AS a; ${s} -- $$` },
  { name: 'in BEGIN … COMMIT', single: false, wrap: (s) => `BEGIN; ${s}; COMMIT` },
  {
    // (A query of its own: Postgres lexes a whole query string before it runs any of it.)
    name: "after SET LOCAL standard_conforming_strings = off, a '\\'' string",
    single: false,
    before: ['BEGIN', 'SET LOCAL standard_conforming_strings = off'],
    wrap: (s) => `SELECT '\\'' AS a; ${s}; -- '`,
  },
]

/** Ways to hide an expression inside one statement (`e` is the call). */
interface ExpressionDisguise {
  name: string
  wrap: (e: string) => string
  /** Queries of their own ahead of it, in one transaction (COMMIT after). */
  before?: string[]
}

const EXPRESSION_DISGUISES: ExpressionDisguise[] = [
  { name: 'after a $$ string', wrap: (e) => `SELECT $$ ' $$ AS a, ${e}` },
  { name: 'after a $tag$ string holding $$', wrap: (e) => `SELECT $q$ $$ ' $q$ AS a, ${e}` },
  { name: 'after a $é$ string holding $$', wrap: (e) => `SELECT $é$ $$ $é$ AS a, ${e} -- $$` },
  { name: "after an E'' string with \\'", wrap: (e) => `SELECT E'it\\'s' AS a, ${e}` },
  { name: "after a U&'' string with UESCAPE", wrap: (e) => `SELECT U&'\\' UESCAPE '!' AS a, ${e} -- '` },
  { name: 'after quoted identifiers "SET" and "\'"', wrap: (e) => `SELECT 1 AS "SET", 2 AS "'", ${e} -- '` },
  { name: 'after a -- comment ended by \\r', wrap: (e) => `SELECT 1 AS a -- note\r, ${e}` },
  { name: 'after a nested /* */ comment', wrap: (e) => `SELECT 1 AS a /* x /* y */ z */, ${e}` },
  {
    name: "after SET LOCAL standard_conforming_strings = off, a '\\'' string",
    before: ['BEGIN', 'SET LOCAL standard_conforming_strings = off'],
    wrap: (e) => `SELECT '\\'' AS a, ${e} -- '`,
  },
]

/** Places in a statement where a call may stand. */
interface Position {
  name: string
  wrap: (e: string) => string
  needsInt?: boolean
  /** Also with the call's argument as a parameter. */
  param?: boolean
}

const POSITIONS: Position[] = [
  { name: 'select list', param: true, wrap: (e) => `SELECT ${e}` },
  { name: 'array slice bound', needsInt: true, param: true, wrap: (e) => `SELECT (array[1, 2])[1:${e}::int] AS a` },
  { name: 'CASE', wrap: (e) => `SELECT CASE WHEN true THEN ${e} END AS a` },
  { name: 'scalar subquery', wrap: (e) => `SELECT (SELECT ${e}) AS a` },
  { name: 'VALUES', wrap: (e) => `VALUES (${e})` },
  { name: 'CTE', param: true, wrap: (e) => `WITH l AS (SELECT ${e} AS a) SELECT * FROM l` },
  { name: 'FROM, with a column alias list', param: true, wrap: (e) => `SELECT * FROM ${e} AS l (a)` },
  { name: 'qualified pg_catalog.', wrap: (e) => `SELECT pg_catalog.${e}` },
]

// ── raw protocol ─────────────────────────────────────────────────────────────────────────────

const int16 = (n: number) => {
  const b = Buffer.alloc(2)
  b.writeInt16BE(n)
  return b
}
const int64 = (n: number) => {
  const b = Buffer.alloc(8)
  b.writeBigInt64BE(BigInt(n))
  return b
}
const arg = (b: Buffer) => Buffer.concat([int32(b.length), b])

/** A FunctionCall ('F'): arguments in text (format 0) or binary (1), a text result. */
export function functionCall(oid: number, args: Buffer[], format: 0 | 1 = 0): Buffer {
  const formats = args.length ? [int16(1), int16(format)] : [int16(0)]
  return message('F', Buffer.concat([int32(oid), ...formats, int16(args.length), ...args.map(arg), int16(0)]))
}
/** Parse (statement name as raw bytes) + Bind + Execute + Sync. */
export function parseBindExecute(name: Buffer, sql: string): Buffer {
  const cname = Buffer.concat([name, Buffer.from([0])])
  return Buffer.concat([
    message('P', Buffer.concat([cname, cstrings([sql]), int16(0)])),
    message('B', Buffer.concat([Buffer.from([0]), cname, int16(0), int16(0), int16(0)])),
    message('E', Buffer.concat([Buffer.from([0]), int32(0)])),
    message('S', Buffer.alloc(0)),
  ])
}

interface RawEntry {
  payload: string
  disguise: string
  leaves: boolean
  /** Postgres's answer to an innocent one. */
  expect?: string
  frames: (n: number) => Buffer
}

function rawEntries({ oids }: CorpusContext): RawEntry[] {
  const text = (s: string) => Buffer.from(s)
  const F = 'FunctionCall message'
  const named = (bytes: number[]) => `Parse named with invalid UTF-8 (${Buffer.from(bytes).toString('hex')})`
  return [
    { payload: 'set_config(…, false)', disguise: F, leaves: true, frames: (n) => functionCall(oids.setConfig, [text(settingName(n)), text('1'), text('false')]) },
    { payload: 'pg_advisory_lock', disguise: F, leaves: true, frames: (n) => functionCall(oids.advisoryLock, [int64(lockKey(n))], 1) },
    { payload: 'pg_try_advisory_lock', disguise: F, leaves: true, frames: (n) => functionCall(oids.tryAdvisoryLock, [text(String(lockKey(n)))]) },
    { payload: 'pg_backend_pid', disguise: F, leaves: false, frames: () => functionCall(oids.backendPid, []) },
    {
      payload: 'set_config(…, false)',
      disguise: named([0xc3, 0x28]),
      leaves: true,
      frames: (n) => parseBindExecute(Buffer.from([0xc3, 0x28]), `SELECT set_config('${settingName(n)}', '1', false)`),
    },
    { payload: 'pg_advisory_lock', disguise: named([0x70, 0xff]), leaves: true, frames: (n) => parseBindExecute(Buffer.from([0x70, 0xff]), `SELECT pg_advisory_lock(${lockKey(n)})`) },
    { payload: 'set_config(…, false)', disguise: 'Parse named é', leaves: true, frames: (n) => parseBindExecute(Buffer.from('é'), `SELECT set_config('${settingName(n)}', '1', false)`) },
    { payload: 'SELECT 1', disguise: named([0xe9]), leaves: false, expect: '22021', frames: () => parseBindExecute(Buffer.from([0xe9]), 'SELECT 1') },
  ]
}

/** The whole corpus, in a fixed order. */
export function buildCorpus(ctx: CorpusContext): Entry[] {
  const out: Entry[] = []
  const add = (payload: string, disguise: string, via: Entry['via'], leaves: boolean, steps: (n: number) => Step[], expect = 'ok') => {
    const n = out.length
    out.push({ n, name: `${payload} × ${disguise} × ${via}`, payload, disguise, via, leaves, expect, steps: steps(n) })
  }
  // Statements × statement disguises × simple / extended.
  for (const s of STATEMENTS) {
    for (const d of STATEMENT_DISGUISES) {
      add(s.name, d.name, 'simple', s.leaves, (n) => {
        const main = { text: d.wrap(s.sql(n, ctx)) }
        return d.before ? [...d.before.map((text) => ({ text })), main, { text: 'COMMIT' }] : [main]
      })
      if (d.single && d.extended && !s.multi) add(s.name, d.name, 'extended', s.leaves, (n) => [{ text: d.wrap(s.sql(n, ctx)), extended: true }])
    }
    if (!s.multi) add(s.name, 'in BEGIN … COMMIT, one query each', 'extended', s.leaves, (n) => [{ text: 'BEGIN' }, { text: s.sql(n, ctx), extended: true }, { text: 'COMMIT' }])
  }
  // Calls × positions × literal / parameter.
  for (const e of EXPRS) {
    for (const p of POSITIONS) {
      if (p.needsInt && !e.castsToInt) continue
      add(e.name, `in ${p.name}`, 'simple', e.leaves, (n) => [{ text: p.wrap(e.call(e.arg(n, ctx).literal)) }])
      if (p.param) add(e.name, `in ${p.name}`, 'param', e.leaves, (n) => {
        const a = e.arg(n, ctx)
        return [{ text: p.wrap(e.call(a.param)), values: [a.value] }]
      })
    }
  }
  // Calls × expression disguises × simple / extended.
  for (const e of EXPRS.filter((x) => x.leaves)) {
    for (const d of EXPRESSION_DISGUISES) {
      for (const extended of [false, true]) {
        add(e.name, d.name, extended ? 'extended' : 'simple', e.leaves, (n) => {
          const main = { text: d.wrap(e.call(e.arg(n, ctx).literal)), extended }
          return d.before ? [...d.before.map((text) => ({ text })), main, { text: 'COMMIT' }] : [main]
        })
      }
    }
  }
  // Raw protocol messages.
  for (const r of rawEntries(ctx)) add(r.payload, r.disguise, 'raw', r.leaves, (n) => [{ raw: r.frames(n) }], r.expect)
  return out
}

/**
 * What a backend holds of any session, read in its own catalogs. `$1`: the custom setting names
 * the corpus uses. One row.
 */
export const PROBE_SQL = `
SELECT pg_backend_pid() AS pid, current_user::text AS current_user, session_user::text AS session_user,
  ARRAY(SELECT kind || ' ' || name FROM (
          SELECT 'relation' AS kind, relname::text AS name FROM pg_class WHERE relnamespace = pg_my_temp_schema()
    UNION ALL SELECT 'function', proname::text FROM pg_proc WHERE pronamespace = pg_my_temp_schema()
    UNION ALL SELECT 'type', typname::text FROM pg_type WHERE typnamespace = pg_my_temp_schema()
    UNION ALL SELECT 'operator', oprname::text FROM pg_operator WHERE oprnamespace = pg_my_temp_schema()
    UNION ALL SELECT 'collation', collname::text FROM pg_collation WHERE collnamespace = pg_my_temp_schema()
    UNION ALL SELECT 'conversion', conname::text FROM pg_conversion WHERE connamespace = pg_my_temp_schema()
    UNION ALL SELECT 'opclass', opcname::text FROM pg_opclass WHERE opcnamespace = pg_my_temp_schema()
    UNION ALL SELECT 'opfamily', opfname::text FROM pg_opfamily WHERE opfnamespace = pg_my_temp_schema()
    UNION ALL SELECT 'ts config', cfgname::text FROM pg_ts_config WHERE cfgnamespace = pg_my_temp_schema()
    UNION ALL SELECT 'ts dictionary', dictname::text FROM pg_ts_dict WHERE dictnamespace = pg_my_temp_schema()
    UNION ALL SELECT 'statistics', stxname::text FROM pg_statistic_ext WHERE stxnamespace = pg_my_temp_schema()
  ) t ORDER BY 1) AS temp,
  ARRAY(SELECT name::text FROM pg_cursors ORDER BY 1) AS cursors,
  ARRAY(SELECT name::text FROM pg_prepared_statements WHERE from_sql ORDER BY 1) AS prepared,
  ARRAY(SELECT c::text FROM pg_listening_channels() c ORDER BY 1) AS listening,
  ARRAY(SELECT concat_ws(':', classid, objid, objsubid) || ' ' || mode FROM pg_locks
        WHERE locktype = 'advisory' AND pid = pg_backend_pid() ORDER BY 1) AS locks,
  ARRAY(SELECT name || '=' || setting FROM pg_settings WHERE source = 'session' ORDER BY 1) AS settings,
  ARRAY(SELECT name || '=' || current_setting(name, true) FROM unnest($1::text[]) name
        WHERE current_setting(name, true) IS NOT NULL AND current_setting(name, true) <> '' ORDER BY 1) AS placeholders,
  ARRAY(SELECT name FROM unnest($1::text[]) name WHERE current_setting(name, true) = '' ORDER BY 1) AS emptied
`

export interface Probe {
  pid: number
  current_user: string
  session_user: string
  temp: string[]
  cursors: string[]
  prepared: string[]
  listening: string[]
  locks: string[]
  settings: string[]
  placeholders: string[]
  emptied: string[]
  /** lastval()'s answer: an error code (55000: no sequence used in this session), or its value. */
  lastval: string
}

/** What `probe` holds that `baseline` (a clean backend, seen the same way) does not. */
export function findings(probe: Probe, baseline: Probe): string[] {
  const out: string[] = []
  for (const key of ['temp', 'cursors', 'prepared', 'listening', 'locks', 'settings', 'placeholders'] as const) {
    const extra = probe[key].filter((x) => !baseline[key].includes(x))
    if (extra.length) out.push(`${key}: ${extra.join(', ')}`)
  }
  if (probe.current_user !== baseline.current_user || probe.session_user !== baseline.session_user) {
    out.push(`current_user/session_user: ${probe.current_user}/${probe.session_user}`)
  }
  if (probe.lastval !== baseline.lastval) out.push(`lastval(): ${probe.lastval}`)
  return out
}
