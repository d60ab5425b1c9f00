/**
 * Asking a backend itself what a session left on it, from Postgres's catalogs: the reading that
 * decides, after any transaction that did more than plain reads and writes, or that may have run
 * code of the database's own. Every name is qualified and every operator spelled
 * OPERATOR(pg_catalog.…), and no literal holds a backslash: the session may have changed
 * search_path, made temporary types, or turned standard strings off.
 */
import { randomBytes } from 'node:crypto'
import { serialize } from 'pg-protocol'

/** What a verification found: state by kind (`statements`: protocol-level prepared statements, which the proxy keeps itself). */
export interface Found {
  left: string[]
  statements: number
}

const EQ = 'OPERATOR(pg_catalog.=)'

/** The name the verification is prepared under on each backend: one no client picks by chance. */
const NAME = `edgepg_verify_${randomBytes(6).toString('hex')}`

/** The verification's messages, for one key's backends. */
export interface Verification {
  /** Where the backend may not hold them prepared: Close and Parse of its statements (planned once per backend, not at each run). */
  prepare: Buffer
  /** After a transaction that was not plain: DISCARD SEQUENCES (nextval's traces, which no catalog shows), then the full account, then Sync. */
  full: Buffer
  /**
   * After a plain one that may have run the database's own code (a trigger, a rule, a policy, a
   * view's function…, made by anyone at any time): what such code may leave that Postgres resets
   * cheaply is reset (nextval's traces, settings made for the session, advisory locks held for it),
   * the rest asked as in `full`. Nothing is assumed of which code the database has.
   */
  light: Buffer
}

/**
 * What is left on a backend, as one row: temporary objects of any kind, cursors (WITH HOLD), SQL
 * prepared statements, LISTEN channels, a role other than the login's, and the count of
 * protocol-level prepared statements (the proxy's to match). `full` adds advisory locks and settings
 * made for the session (pg_locks and pg_settings: most of its cost). The light one releases advisory
 * locks instead, and counts no protocol-level statements (code sends no protocol messages).
 */
export function verificationSql(user: string, full = true): string {
  const is = (kind: string, test: string) => `CASE WHEN ${test} THEN '${kind}' END`
  return `SELECT pg_catalog.concat_ws(' ',
  ${is('temporary', `pg_catalog.pg_my_temp_schema() OPERATOR(pg_catalog.<>) 0 AND EXISTS (SELECT FROM pg_catalog.pg_depend WHERE refclassid ${EQ} 2615 AND refobjid ${EQ} pg_catalog.pg_my_temp_schema())`)},
  ${is('cursor', 'EXISTS (SELECT FROM pg_catalog.pg_cursors WHERE is_holdable)')},
  ${is('prepare', 'EXISTS (SELECT FROM pg_catalog.pg_prepared_statements WHERE from_sql)')},
  ${is('listen', 'EXISTS (SELECT FROM pg_catalog.pg_listening_channels())')},${
    full
      ? `
  ${is('lock', `EXISTS (SELECT FROM pg_catalog.pg_locks WHERE locktype ${EQ} 'advisory' AND pid ${EQ} pg_catalog.pg_backend_pid())`)},
  ${is('setting', `EXISTS (SELECT FROM pg_catalog.pg_settings WHERE source ${EQ} 'session')`)},`
      : ''
  }
  ${is('role', `NOT (current_user ${EQ} ${literal(user)} AND session_user ${EQ} ${literal(user)})`)},
  'statements', ${
    full
      ? `(SELECT pg_catalog.count(*) FROM pg_catalog.pg_prepared_statements WHERE NOT from_sql AND name OPERATOR(pg_catalog.!~~) '${NAME}%')`
      : `(SELECT 0 FROM pg_catalog.pg_advisory_unlock_all())`
  })`
}

/** The verification's messages (see Verification). */
export function verification(user: string): Verification {
  // Named, not unnamed: the session's unnamed statement outlives its transaction, and is its own.
  const run = (name: string) => [serialize.bind({ statement: name }), serialize.execute()]
  const prepared = (name: string, text: string) => [serialize.close({ type: 'S', name }), serialize.parse({ name, text })]
  const [discard, reset, light] = ['discard', 'reset', 'light'].map((part) => `${NAME}_${part}`)
  const sync = serialize.sync()
  return {
    prepare: Buffer.concat([
      ...prepared(NAME, verificationSql(user)),
      ...prepared(light, verificationSql(user, false)),
      ...prepared(discard, 'DISCARD SEQUENCES'),
      ...prepared(reset, 'RESET ALL'),
    ]),
    full: Buffer.concat([...run(discard), ...run(NAME), sync]),
    light: Buffer.concat([...run(discard), ...run(reset), ...run(light), sync]),
  }
}

/** A verification's answer, from the first column of its rows; undefined: it failed, or never came. */
export function found(rows: string[]): Found | undefined {
  const words = rows[0]?.split(' ')
  if (rows.length !== 1 || !words || words.length < 2 || words[words.length - 2] !== 'statements') return undefined
  const statements = Number(words.pop())
  words.pop()
  return { left: words, statements }
}

/** A string literal Postgres reads the same with standard_conforming_strings on or off (a backslash reads as itself only with it on: then no match, which is safe). */
function literal(text: string): string {
  return `'${text.replace(/'/g, "''")}'`
}
