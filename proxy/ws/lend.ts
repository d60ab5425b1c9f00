/** A lent session's hold on a backend, shared by its parts (proxy/ws/lent-session.ts, lent-reads.ts). */
import type { Backend } from '../pool/backends'
import type { Lender } from '../pool/lender'
import type { IdleWatch } from '../pool/idle-watch'
import type { StatementRelay } from '../pool/prepared'
import type { Reading } from '../isolation/reader'
import type { OnReplica } from '../replicas/session-reads'
import { ServerMessage, TxStatus } from '../wire/codes'

export interface Lend {
  backend: Backend
  /** The backend changed hands, and its reset is not answered yet: what the session sent behind it (sent elsewhere if Postgres refuses the reset), and whether a Sync went (nothing more goes until the answer). */
  handover?: { sent: Buffer[]; bytes: number; synced: boolean }
  /** Whose backend it is: the session's key's on the primary, or on a replica. */
  lender: Lender
  onReplica?: OnReplica
  /** ReadyForQuery messages of the lend's the client has been sent. */
  delivered: number
  /** The primary's position is being asked behind the session's messages: their last ReadyForQuery waits for it here. */
  positionDue: number
  /** A COPY FROM STDIN ends the transaction: the position is asked once Postgres has answered all (see LentReads.behind). */
  positionAfter?: boolean
  tail?: Buffer
  relay: StatementRelay
  watch: IdleWatch
  /** What the transaction's statements may have left behind, as the parser reads them. */
  effects: Reading
}

export const READY_IDLE = Buffer.from([ServerMessage.ReadyForQuery, 0, 0, 0, 5, TxStatus.Idle])
