/**
 * What a backend holds that its session keeps, and what is asked of it: the handover's reset and a
 * session's own state. Nothing here rests on anything a session can create, replace or read its way
 * into: the texts are parsed by Postgres afresh each time (no prepared statement of the proxy's
 * exists for a session to find in pg_prepared_statements, close, or make again under its name),
 * every name is qualified and every operator spelled OPERATOR(pg_catalog.…), and no literal holds a
 * backslash (the session may have changed search_path, made temporary types, or turned standard
 * strings off).
 */
import { randomFillSync } from 'node:crypto'
import { serialize } from 'pg-protocol'

/**
 * What a verification found: state by kind; protocol-level prepared statements, which the proxy
 * keeps itself (`statements`); and the settings made for the session (name → value), which follow it.
 */
export interface Found {
  left: string[]
  statements: number
  settings: Record<string, string>
}

const EQ = 'OPERATOR(pg_catalog.=)'
/** Settings whose timeout ends the backend (FATAL) while it sits idle: a session that sets them keeps its backend rather than have them carried. */
const ENDS_BACKEND = `'{idle_session_timeout,idle_in_transaction_session_timeout,transaction_timeout}'::pg_catalog.text[]`
/** Settings SET TRANSACTION leaves marked as the session's, though every transaction starts them afresh from their defaults. */
const TRANSACTION_SCOPED = `'{transaction_isolation,transaction_read_only,transaction_deferrable}'::pg_catalog.text[]`

/**
 * Reset at the head of the first write to a backend that changes hands, in the next session's first
 * Sync group: DISCARD ALL, a utility command (no plan, no name a session can redefine), then a fresh
 * seed (reseed). DISCARD ALL may not run inside a transaction block, so Postgres commits it on its own
 * before anything behind it starts (what fails behind it never brings back what it undid), and
 * refuses it on a backend left inside one; if it fails, Postgres skips the rest of the group, which
 * the proxy then sends elsewhere. Unnamed: whatever the next session names, it replaces or (by the
 * relay's Close) finds none.
 */
export function handoverReset(): Buffer {
  const reset = Buffer.from(HANDOVER) // (one copy: a handover comes with most statements of a busy key)
  reset.writeDoubleBE(seed(), DISCARD.length + SEED_AT)
  return reset
}
/** What a handover's reset answers with, each ending one of its parts: DISCARD ALL's CommandComplete, the call's ReadyForQuery (or the first refused, an error). */
export const HANDOVER_ENDS = 2
const DISCARD = Buffer.concat([serialize.parse({ text: 'DISCARD ALL' }), serialize.bind({}), serialize.execute({})])

/**
 * A fresh seed for random() and its kin, which DISCARD ALL leaves as the last session set it
 * (setseed: the next session's every draw would be the last one's to choose or know), from the
 * proxy's own strong randomness. By a FunctionCall message, answered with a ReadyForQuery of its own:
 * no statement to plan (a SELECT costs Postgres ~10 µs more), no text for pg_stat_activity to show,
 * and a transaction of its own (a SELECT left in the implicit transaction of extended messages stays
 * open through a simple Query that follows). Postgres skips it, as the rest, once DISCARD ALL is refused.
 */
export function reseed(): Buffer {
  const call = Buffer.from(RESEED)
  call.writeDoubleBE(seed(), SEED_AT)
  return call
}
/**
 * FunctionCall ('F', length 28) of pg_catalog.setseed(float8) by its OID, 1599 (a built-in's: the same
 * in every release); one format code, binary, for its one argument, 8 bytes at SEED_AT; the result as text.
 */
const RESEED = Buffer.from('46' + '0000001c' + '0000063f' + '0001' + '0001' + '0001' + '00000008' + '0000000000000000' + '0000', 'hex')
const SEED_AT = 19
const HANDOVER = Buffer.concat([DISCARD, RESEED])

/** A double in [0, 1) of 53 random bits, drawn in batches. */
const drawn = new Uint32Array(1024)
let unused = 0
function seed(): number {
  if (unused < 2) randomFillSync(drawn), (unused = drawn.length)
  return ((drawn[--unused] >>> 11) * 2 ** 32 + drawn[--unused]) / 2 ** 53
}

/**
 * What a session left on its backend, as one row of JSON: temporary objects of any kind, cursors
 * (WITH HOLD), SQL prepared statements, LISTEN channels, advisory locks, custom settings (`app.x`: a
 * placeholder stays behind) and the timeouts that end a backend, a role other than the login's; the count of protocol-level prepared
 * statements (the proxy's to match); and the settings made for the session, with their values (the
 * proxy sets them again on each backend the session borrows: see carrySettings). Asked after a
 * transaction that did more than plain reads and writes (by the parser and Postgres's command tags),
 * to keep the backend with its session while it holds anything else: a simple Query, planned afresh
 * (about 1 ms of Postgres's time: npm run bench -- isolation), so that no session can answer it in
 * Postgres's place. (Like any Query, it drops the session's unnamed statement.)
 */
export function verificationSql(user: string): string {
  const is = (kind: string, test: string) => `CASE WHEN ${test} THEN '${kind}' END`
  // (Custom settings leave a placeholder; the timeouts that end a backend would, carried, end one per statement: both stay where they were made.)
  const custom = `(pg_catalog.strpos(name, '.') OPERATOR(pg_catalog.>) 0 OR name ${EQ} ANY (${ENDS_BACKEND}))`
  const session = `source ${EQ} 'session' AND NOT name ${EQ} ANY (${TRANSACTION_SCOPED})`
  return `SELECT pg_catalog.json_build_array(pg_catalog.concat_ws(' ',
  ${is('temporary', `pg_catalog.pg_my_temp_schema() OPERATOR(pg_catalog.<>) 0 AND EXISTS (SELECT FROM pg_catalog.pg_depend WHERE refclassid ${EQ} 2615 AND refobjid ${EQ} pg_catalog.pg_my_temp_schema())`)},
  ${is('cursor', 'EXISTS (SELECT FROM pg_catalog.pg_cursors WHERE is_holdable)')},
  ${is('prepare', 'EXISTS (SELECT FROM pg_catalog.pg_prepared_statements WHERE from_sql)')},
  ${is('listen', 'EXISTS (SELECT FROM pg_catalog.pg_listening_channels())')},
  ${is('lock', `EXISTS (SELECT FROM pg_catalog.pg_locks WHERE locktype ${EQ} 'advisory' AND pid ${EQ} pg_catalog.pg_backend_pid())`)},
  ${is('setting', `EXISTS (SELECT FROM pg_catalog.pg_settings WHERE ${session} AND ${custom})`)},
  ${is('role', `NOT (current_user ${EQ} ${literal(user)} AND session_user ${EQ} ${literal(user)})`)}),
  (SELECT pg_catalog.count(*) FROM pg_catalog.pg_prepared_statements WHERE NOT from_sql),
  (SELECT pg_catalog.json_object_agg(name, setting) FROM pg_catalog.pg_settings WHERE ${session} AND NOT ${custom} AND NOT name ${EQ} ANY ('{role,session_authorization}'::pg_catalog.text[])))`
}

/** The verification as a simple Query (see verificationSql). */
export const verification = (user: string): Buffer => serialize.query(verificationSql(user))

/** A verification's answer, from the first column of its rows; undefined: it failed, or never came. */
export function found(rows: string[]): Found | undefined {
  if (rows.length !== 1) return undefined
  try {
    const [words, statements, settings] = JSON.parse(rows[0]) as [string, number, Record<string, string> | null]
    return { left: words ? words.split(' ') : [], statements, settings: settings ?? {} }
  } catch {
    return undefined
  }
}

/**
 * The session's settings set again on a backend it borrows, ahead of its messages: a FunctionCall of
 * pg_catalog.set_config(text, text, boolean) by its OID, 2078 (a built-in's), per setting, name and
 * value as text arguments (nothing read as SQL). Each runs in a transaction of its own, answered with
 * a ReadyForQuery (`ends`): a statement here would leave the implicit transaction of extended messages
 * open through the session's simple Query behind it. Skipped, as the rest, once DISCARD ALL is refused.
 */
export function carrySettings(settings: Record<string, string>): Carried | undefined {
  const names = Object.keys(settings)
  if (!names.length) return undefined
  return { names, bytes: Buffer.concat(names.map((name) => setConfig(name, settings[name]))), ends: names.length }
}
export type Carried = { names: string[]; bytes: Buffer; ends: number }

function setConfig(name: string, value: string): Buffer {
  const args = [name, value, 'false'].map((a) => Buffer.from(a, 'utf8'))
  const length = 4 + 4 + 2 + 2 + 2 + args.reduce((n, a) => n + 4 + a.length, 0) + 2
  const call = Buffer.alloc(1 + length)
  let at = call.writeUInt8(0x46, 0) // 'F'
  at = call.writeInt32BE(length, at)
  at = call.writeInt32BE(SET_CONFIG_OID, at)
  at = call.writeInt16BE(1, at) // one format code for all arguments: text
  at = call.writeInt16BE(0, at)
  at = call.writeInt16BE(args.length, at)
  for (const a of args) (at = call.writeInt32BE(a.length, at)), (at += a.copy(call, at))
  call.writeInt16BE(0, at) // the result as text
  return call
}
const SET_CONFIG_OID = 2078

/** A string literal Postgres reads the same with standard_conforming_strings on or off (a backslash reads as itself only with it on: then no match, which is safe). */
function literal(text: string): string {
  return `'${text.replace(/'/g, "''")}'`
}
