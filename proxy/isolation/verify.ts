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
 * What a verification found: state by kind that pins; protocol-level prepared statements, which the
 * proxy keeps itself (`statements`); and what follows the session (see carry): its settings (name →
 * value), the role it set, and its SQL prepared statements (name → the query string that made it).
 */
export interface Found {
  left: string[]
  statements: number
  settings: Record<string, string>
  role?: string
  prepared: [name: string, text: string][]
  /** The channels it listens on (pg_listening_channels()). */
  channels: string[]
}

/** SQL prepared statements a session may have follow it, and the text of the query strings that made them (and of its settings' values: proxy/pool/session-state.ts); past either, they pin. */
export const CARRIED_STATEMENTS = 100
export const CARRIED_TEXT_BYTES = 64 << 10

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
 * What a session left on its backend, as one row of JSON: what pins it (temporary objects of any
 * kind, cursors WITH HOLD, LISTEN channels, advisory locks, custom settings (`app.x`: a placeholder
 * stays behind) and the timeouts that end a backend, a session authorization other than the
 * login's, more SQL prepared statements than follow a session); the count of protocol-level prepared
 * statements (the proxy's to match); and what follows the session to each backend it borrows (see
 * carry): the settings made for it with their values, the role it set, its SQL prepared statements
 * with the query strings that made them (false: past what follows a session). Asked after a
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
  ${is('listen', 'EXISTS (SELECT FROM pg_catalog.pg_listening_channels())')},
  ${is('lock', `EXISTS (SELECT FROM pg_catalog.pg_locks WHERE locktype ${EQ} 'advisory' AND pid ${EQ} pg_catalog.pg_backend_pid())`)},
  ${is('setting', `EXISTS (SELECT FROM pg_catalog.pg_settings WHERE ${session} AND ${custom})`)},
  ${is('role', `NOT session_user ${EQ} ${literal(user)}`)}),
  (SELECT pg_catalog.count(*) FROM pg_catalog.pg_prepared_statements WHERE NOT from_sql),
  (SELECT pg_catalog.json_object_agg(name, setting) FROM pg_catalog.pg_settings WHERE ${session} AND NOT ${custom}),
  CASE WHEN NOT current_user ${EQ} ${literal(user)} THEN pg_catalog.current_setting('role') END,
  (SELECT CASE WHEN pg_catalog.count(*) OPERATOR(pg_catalog.>) ${CARRIED_STATEMENTS} OR pg_catalog.sum(pg_catalog.octet_length(statement)) OPERATOR(pg_catalog.>) ${CARRIED_TEXT_BYTES} THEN 'false'::pg_catalog.json
    ELSE pg_catalog.json_agg(pg_catalog.json_build_array(name, statement) ORDER BY prepare_time) END FROM pg_catalog.pg_prepared_statements WHERE from_sql),
  (SELECT pg_catalog.json_agg(c) FROM pg_catalog.pg_listening_channels() c))`
}

/** The verification as a simple Query (see verificationSql). */
export const verification = (user: string): Buffer => serialize.query(verificationSql(user))

/** A verification's answer, from the first column of its rows; undefined: it failed, or never came. */
export function found(rows: string[]): Found | undefined {
  if (rows.length !== 1) return undefined
  try {
    const [words, statements, settings, role, prepared, channels] = JSON.parse(rows[0]) as [string, number, Record<string, string> | null, string | null, [string, string][] | false | null, string[] | null]
    const left = words ? words.split(' ') : []
    if (prepared === false) left.push('prepare')
    return { left, statements, settings: settings ?? {}, ...(role !== null && { role }), prepared: prepared || [], channels: channels ?? [] }
  } catch {
    return undefined
  }
}

/**
 * A session's state made again on a backend it borrows, ahead of its messages, in their Sync group:
 * its settings, then its role, by pg_catalog.set_config, names and values passed as one JSON
 * parameter (nothing read as SQL); then its SQL prepared statements, each by the PREPARE that made
 * it; then a LISTEN for each channel it listens on (proxy/notify/), so that pg_listening_channels()
 * answers for the session wherever it runs (notifications come to it from the hub, not from there).
 * In a transaction block of its own, as extended messages: what Postgres refuses makes it skip
 * the rest of the group, the session's messages with it, which then go to another backend; and the
 * block's COMMIT leaves no transaction open under what follows (a statement outside a block would
 * leave the implicit one of extended messages open through the session's). Each part answers with
 * a CommandComplete (`ends`).
 */
export function carry(settings: Record<string, string>, role: string | undefined, prepares: string[], channels: readonly string[] = []): Carried | undefined {
  const names = Object.keys(settings)
  if (role !== undefined) (settings = { ...settings, role }), names.push('role')
  if (!names.length && !prepares.length && !channels.length) return undefined
  const parts = [BEGIN]
  if (names.length) parts.push(extended(SET_CONFIG, [JSON.stringify(settings)]))
  for (const text of prepares) parts.push(extended(text, []))
  for (const channel of channels) parts.push(extended(`LISTEN ${quoted(channel)}`, []))
  parts.push(COMMIT)
  const counted = (n: number, what: string) => (n ? [`${n} ${what}${n > 1 ? 's' : ''}`] : [])
  return { names: [...names, ...counted(prepares.length, 'prepared statement'), ...counted(channels.length, 'LISTEN channel')], bytes: Buffer.concat(parts), ends: parts.length }
}

/** A name as a quoted identifier: Postgres reads back its exact text. */
export const quoted = (name: string) => `"${name.replace(/"/g, '""')}"`
export type Carried = { names: string[]; bytes: Buffer; ends: number }

const extended = (text: string, values: string[]) => Buffer.concat([serialize.parse({ text }), serialize.bind({ values }), serialize.execute({})])
const BEGIN = extended('BEGIN', [])
const COMMIT = extended('COMMIT', [])
/** In the order given (role last: the settings are the login's to make, as the session made them before SET ROLE, as a rule). */
const SET_CONFIG = 'SELECT pg_catalog.set_config(s.key, s.value, false) FROM pg_catalog.json_each_text($1::pg_catalog.json) WITH ORDINALITY AS s(key, value, n) ORDER BY s.n'

/** A string literal Postgres reads the same with standard_conforming_strings on or off (a backslash reads as itself only with it on: then no match, which is safe). */
function literal(text: string): string {
  return `'${text.replace(/'/g, "''")}'`
}
